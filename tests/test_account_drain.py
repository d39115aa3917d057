"""When a batch drains: vLLM's empty steps report finished requests, and under async scheduling
one can come while the GPU still runs the rest of the batch (docs/request-energy.md, short bursts).
The account takes the batch as drained once every request of its last step has been reported,
whichever steps reported them."""

from __future__ import annotations

import pytest
from fakes import Clock

from vllm_powersave.energy import PhaseEnergyAccount
from vllm_powersave.energy.meters import EnergyMeter


class SteadyMeter(EnergyMeter):
    """300 W throughout; ``fail`` makes it unavailable."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.fail = clock, False

    def energy_j(self):
        return None if self.fail else 300.0 * self.clock()

    def power_w(self):
        return None

    def sm_clock_mhz(self):
        return None


def _account(per_request=True, gpu_runs_ahead=False, done=None):
    clock = Clock()
    meter = SteadyMeter(clock)
    report = (lambda r, j: done.append((r, j))) if done is not None else None
    acc = PhaseEnergyAccount(meter, 0.25, clock=clock, per_request=per_request, gpu_runs_ahead=gpu_runs_ahead, on_request_done=report)
    return acc, clock, meter


def test_a_request_never_reported_lets_the_batch_reach_idle_after_idle_after_s():
    acc, clock, _ = _account()
    acc.on_step("prefill", 10, 0, {"A": 5, "B": 5}, set(), t=0.0)
    acc.on_step_end(t=0.05)
    acc.on_finished({"A"}, t=0.06)  # B aborted without a report
    while clock.t < 2.0:
        clock.t = round(clock.t + 0.05, 9)
        acc.tick()
    assert acc.current_phase == "idle"
    assert acc.energy_j["prefill"] <= 300 * (0.05 + 0.25) + 1e-6, acc.energy_j
    assert acc.total_j() == pytest.approx(600.0)


@pytest.mark.parametrize("gpu_runs_ahead", [False, True])
def test_the_gap_after_a_batch_reported_over_two_steps_is_no_requests(gpu_runs_ahead):
    """A reported by an empty step, B by the next real step: every request of the step before the
    gap has finished, so the gap goes to the tail, as when both come with the next step (before,
    A and B took 30 J each of a gap that is no one's)."""

    def requests_j(split: bool) -> dict:
        done: list = []
        acc, clock, _ = _account(done=done, gpu_runs_ahead=gpu_runs_ahead)
        acc.on_step("prefill", 10, 0, {"A": 5, "B": 5}, set(), t=0.0)
        acc.on_step_end(t=0.01)
        if split:
            acc.on_finished({"A"}, t=0.011)
        acc.on_step("decode", 0, 1, {"C": 1}, {"B"} if split else {"A", "B"}, t=0.2)
        acc.on_step_end(t=0.21)
        clock.t = 0.22
        acc.tick()
        return dict(done)

    split, together = requests_j(True), requests_j(False)
    assert set(split) == {"A", "B"} and split == pytest.approx(together, abs=1e-6)


def test_an_empty_step_before_the_steps_end_still_counts():
    """A reported before the step's end was recorded, B after it: the batch drained, and the work
    ended with the step."""
    acc, clock, _ = _account()
    acc.on_step("prefill", 10, 0, {"A": 5, "B": 5}, set(), t=0.0)
    acc.on_finished({"A"}, t=0.04)
    acc.on_step_end(t=0.05)
    acc.on_finished({"B"}, t=0.06)
    clock.t = 0.1
    acc.tick()
    assert acc.current_phase == "idle"
    assert acc.energy_j["prefill"] == pytest.approx(300 * 0.06)


def test_all_reported_before_the_steps_end_rests_from_the_end():
    acc, clock, _ = _account()
    acc.on_step("prefill", 10, 0, {"A": 5}, set(), t=0.0)
    acc.on_finished({"A"}, t=0.04)  # the step's end is recorded after its report
    acc.on_step_end(t=0.05)
    clock.t = 0.1
    acc.tick()
    assert acc.current_phase == "idle" and acc.energy_j["prefill"] == pytest.approx(300 * 0.05)


def test_without_per_request_energy_a_meter_fault_reports_no_request():
    """The step events carry request ids for the drain rule; with per-request energy off no
    request is ever reported, a fault included."""
    done: list = []
    acc, clock, meter = _account(per_request=False, done=done)
    acc.on_step("prefill", 10, 0, {"A": 5, "B": 5}, set(), t=0.0)
    clock.t = 0.02
    acc.tick()
    meter.fail = True
    acc.on_step_end(t=0.03)
    clock.t = 0.04
    acc.tick()
    acc.on_finished({"A", "B"}, t=0.05)
    clock.t = 0.1
    acc.tick()
    assert done == [] and not acc.available


def test_phases_are_the_same_with_and_without_per_request_energy():
    def phases(per_request: bool) -> dict:
        acc, clock, _ = _account(per_request=per_request, gpu_runs_ahead=True)
        acc.on_step("prefill", 10, 0, {"A": 5, "B": 5}, set(), t=0.0)
        acc.on_step_end(t=0.01)
        acc.on_finished({"A"}, t=0.012)
        acc.on_finished({"B"}, t=0.1)
        acc.on_step("decode", 0, 1, {"C": 1}, set(), t=0.5)
        acc.on_step_end(t=0.51)
        for t in (0.05, 0.3, 0.6):
            clock.t = t
            acc.tick()
        return dict(acc.energy_j)

    assert phases(True) == pytest.approx(phases(False))
