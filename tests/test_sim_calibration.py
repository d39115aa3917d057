"""The simulated GPU's fit to public per-clock data, and mis-modelled variants (all simulated)."""

import csv

import pytest

from vllm_powersave.sim.calibrate import (
    H200_MEASURED,
    MA_ANCHORS,
    build,
    fit_public_gpu,
    h200_anchor_values,
    h200_residuals,
    load_curves,
    norm_power,
    norm_time,
)
from vllm_powersave.sim.gpu import H200, StepWork, misfit, predict, simulate_step


def test_fitted_h200_meets_the_public_decode_ranges_and_the_measured_points():
    v = h200_anchor_values(H200)
    res = h200_residuals(H200)
    for k in MA_ANCHORS:
        # Inside the published range, up to 1 % of its width (the fit sits on the +13 % edge; the
        # constants are rounded to 0.1 W).
        assert abs(res[k]) <= 0.01, (k, v[k])
    assert v["gemm_tflops"] == pytest.approx(H200_MEASURED["gemm_tflops"], rel=0.05)
    assert v["gemm_w"] == pytest.approx(H200_MEASURED["gemm_w"], rel=0.02)
    assert v["copy_w"] == pytest.approx(H200_MEASURED["copy_w"], rel=0.02)


def test_sim_gpu_constants_are_the_fit(tmp_path):
    _, doc = build(tmp_path / "missing.csv")  # the H200 fit needs no file; the public curves do
    assert doc["simulated"] is True and doc["h200"]["sim_gpu_uses_this_fit"] is True
    before, after = doc["h200"]["residuals_before"], doc["h200"]["residuals_after"]
    assert sum(x * x for x in after.values()) < sum(x * x for x in before.values())


def test_predict_keeps_its_contract_on_the_fitted_gpu():
    t, p, e = predict(StepWork(1e9, 4e9), 1200)
    assert e == pytest.approx(p * t) and t > 0 and p > H200.p_idle_w


def test_misfit_scales_the_clock_response_and_moves_the_knee():
    mem = StepWork(flops=1e9, bytes=4e9)
    for err in (0.3, -0.3):
        g = misfit(H200, err)
        assert g.mem_bound_min_mhz == round(H200.mem_bound_min_mhz * (1 + err))
        assert simulate_step(g, mem, H200.f_max_mhz).time_s == pytest.approx(simulate_step(H200, mem, H200.f_max_mhz).time_s)
    f = 600  # below every knee: the slowdown is scaled by 1 + error on top of the moved knee
    base = simulate_step(H200, mem, H200.f_max_mhz).time_s
    plus = simulate_step(misfit(H200, 0.3), mem, f).time_s / base - 1
    nominal = simulate_step(H200, mem, f).time_s / base - 1
    assert plus > 1.3 * nominal > 0
    assert simulate_step(misfit(H200, -0.3), mem, 700).time_s == pytest.approx(base, rel=1e-3)  # knee 546 MHz: flat at 700


def test_public_curve_fit_recovers_a_known_response(tmp_path):
    # A synthetic GPU with known physics, written in points.csv's format: the fit must find it.
    f_max, u_c, knee, s, v_min = 3000.0, 0.35, 0.3, 0.45, 0.65
    rows = []
    for f in (1200, 1500, 1800, 2100, 2400, 2700, 3000):
        t = norm_time(f, f_max, u_c, knee) / 100.0
        p = 300 * norm_power(f, f_max, s, v_min)
        for metric, v in (("throughput", 1 / t), ("board_power", p)):
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
    rows.append({**rows[0], "exactness": "verbal", "value": "about 3"})
    path = tmp_path / "points.csv"
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    curves, skipped = load_curves(path)
    assert len(curves) == 1 and skipped and "verbal" in skipped[0]["why"][0]
    fit = fit_public_gpu(curves)
    c = fit["curves"][0]
    assert c["median_abs_err_time"] < 0.005 and c["median_abs_err_power"] < 0.005
    assert c["compute_share"] == pytest.approx(u_c, abs=0.03)
    assert c["best_efficiency_err_mhz"] == 0
