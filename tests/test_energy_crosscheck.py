"""The energy counter against the integral of instant power (energy/crosscheck.py): a gauge per GPU
on /metrics, in loadtests' scrape, and one warning when they disagree beyond the bound."""

import json
import logging
import random

import pytest
from fakes import FakeNvmlDevices, metrics_text
from test_energy import Clock, CounterGpu

from vllm_powersave.device import NvmlGpu
from vllm_powersave.energy import NvmlEnergyMeter
from vllm_powersave.energy.crosscheck import CROSSCHECK_BOUND, CROSSCHECK_WINDOW_S


class DriftingCounterGpu(CounterGpu):
    """A counter that reads ``scale`` x the true energy (instant power stays the true one)."""

    def __init__(self, clock, segments, scale):
        super().__init__(clock, segments)
        self.scale = scale

    def raw_mj(self):
        return int(7_000_000 + (super().raw_mj() - 7_000_000) * self.scale)


def serve(gpu, clock, seconds, seed=0):
    """Read the meter as the publisher does: a tick every 0.1-0.25 s, flushes 10-30 ms apart
    while the load is high, the counter's phase synced when due. Returns the meter."""
    rng = random.Random(seed)
    clock.t = 0.5
    meter = NvmlEnergyMeter(NvmlGpu(gpu, 0, "GPU-x"), clock=clock)

    def sleep(s):
        clock.t += s

    while clock.t < seconds:
        busy = gpu.power_at(clock.t) > 200
        clock.t += rng.uniform(0.01, 0.03) if busy and rng.random() < 0.7 else rng.uniform(0.1, 0.25)
        if clock.t >= meter.sync_due:
            meter.sync_counter_phase(sleep=sleep)
        meter.energy_j()
    return meter


def load_trace(seed, seconds):
    """Idle spells, bursts and steady stretches from 80 to 700 W."""
    rng, segs, t = random.Random(seed), [(0.0, 80.0)], 0.0
    while t < seconds:
        t += rng.uniform(0.1, 4.0)
        segs.append((t, rng.choice([80.0, 80.0, 300.0, 470.0, 700.0])))
    return segs


@pytest.mark.parametrize("seed", range(3))
def test_a_counter_that_agrees_with_its_power_reads_about_1_and_warns_never(seed, caplog):
    clock = Clock()
    meter = serve(CounterGpu(clock, load_trace(seed, 130)), clock, 130, seed)
    cc = meter.crosscheck
    assert cc.windows >= 3 and cc.window_s >= CROSSCHECK_WINDOW_S
    assert cc.ratio == pytest.approx(1.0, abs=0.02)
    assert cc.warnings == 0 and not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_drifting_counter_reads_off_and_warns_exactly_once(caplog):
    clock = Clock()
    meter = serve(DriftingCounterGpu(clock, load_trace(5, 200), scale=1.10), clock, 200)
    cc = meter.crosscheck
    assert cc.windows >= 5 and cc.ratio == pytest.approx(1.10, abs=0.02)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and cc.warnings == 1, [r.getMessage() for r in warnings]
    assert "integral of instant power" in warnings[0].getMessage() and "GPU-x" in warnings[0].getMessage()
    assert 1.0 + CROSSCHECK_BOUND < cc.ratio


def test_no_power_reading_no_ratio():
    """Without instant power (every power read failing) there is nothing to integrate: no ratio,
    no warning, and the counter still serves."""
    nvml, clock = FakeNvmlDevices(power_w=300.0), Clock()
    nvml.faults.update(nvmlDeviceGetFieldValues=999, nvmlDeviceGetPowerUsage=999)
    meter = NvmlEnergyMeter(NvmlGpu(nvml, 0, "GPU-n"), clock=clock)
    for _ in range(400):
        clock.t += 0.25
        nvml.energy_mj[0] += 75_000
        assert meter.energy_j() is not None
    assert meter.crosscheck.ratio is None and meter.crosscheck.warnings == 0


def test_the_ratio_is_a_gauge_on_metrics_and_in_the_loadtests_scrape(tmp_path):
    snap = {"gpu": "GPU-a", "rank": 0, "source": "measured", "energy_method": "energy-counter", "energy_available": True}
    (tmp_path / "rank0.json").write_text(json.dumps({**snap, "energy_crosscheck_ratio": 1.004, "energy_crosscheck_window_s": 30.2}))
    text = metrics_text(tmp_path)
    assert 'powersave_energy_crosscheck_ratio{gpu="GPU-a"} 1.004' in text
    from loadtests.energy import parse_scrape

    assert parse_scrape(text).energy_crosscheck_ratio == {"GPU-a": pytest.approx(1.004)}
    (tmp_path / "rank0.json").write_text(json.dumps(snap))  # before the first window: absent
    text = metrics_text(tmp_path)
    assert "powersave_energy_crosscheck_ratio{" not in text
    assert parse_scrape(text).energy_crosscheck_ratio is None
