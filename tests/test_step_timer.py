"""Where the closed loop's step times come from (device/step_timer.py): on a GPU the step's span
on the device (CUDA events), never the engine thread's launch time; the simulator's time under a
simulated clock; the wall time on vLLM's CPU build. A timer fault turns only the closed loop off."""

import json
import logging
import math
import sys
from types import SimpleNamespace

import pytest
from fakes import FakeCudaStepTimer, FakeNvmlDevices, metrics_text
from test_closed_loop_runtime import _decode

from vllm_powersave import runtime as rt_mod
from vllm_powersave import vllm_compat
from vllm_powersave.clocks import mode as mode_mod
from vllm_powersave.device.step_timer import SimulatedStepTimer
from vllm_powersave.runtime import build
from vllm_powersave.settings import PowersaveSettings


def _gpu_runtime(monkeypatch, tmp_path, timer_factory=None, extra=None):
    # vLLM's logging config (loaded by an earlier test's engine) may stop "vllm.*" at its own handler
    # or disable loggers that existed before it; caplog listens on the root logger.
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    monkeypatch.setattr(logging.getLogger("vllm.powersave"), "disabled", False)  # dictConfig disables existing loggers
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvmlDevices(uuids=("GPU-aaaa-0000",)))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa-0000")
    monkeypatch.setenv("POWERSAVE_FORCE_DRY_RUN", "1")
    monkeypatch.setattr(mode_mod, "clock_permission", lambda: (False, "test: no permission"))
    monkeypatch.setattr(vllm_compat, "runner_identity", lambda r: {"rank": 0, "device_type": "cuda", "device_index": 0})
    if timer_factory is not None:
        monkeypatch.setattr(build, "CudaEventStepTimer", timer_factory)
    runner = SimpleNamespace(rank=0, scheduler_config=SimpleNamespace(max_num_seqs=64, async_scheduling=True))
    cfg = {"stats_dir": str(tmp_path), "trace_steps": True, "cuda_perf_boost": "on", "energy": {"idle_after_s": 20.0}, **(extra or {})}
    return rt_mod.WorkerRuntime(runner, PowersaveSettings.model_validate(cfg))


def _decisions(tmp_path):
    lines = [json.loads(x) for x in (tmp_path / "trace-rank0.jsonl").read_text().splitlines()]
    return [x["closed_loop"] for x in lines if "closed_loop" in x]


def test_on_a_gpu_the_closed_loop_learns_the_steps_gpu_time_not_the_launch_time(monkeypatch, tmp_path):
    timer = FakeCudaStepTimer(gpu_ms=7.25)  # the engine thread returns in microseconds; the GPU takes 7.25 ms
    rt = _gpu_runtime(monkeypatch, tmp_path, lambda device_index: timer)
    try:
        assert rt.step_time_source == "cuda_events"
        for _ in range(80):
            rt.on_step_start(_decode(32))
            rt.on_step_end()
        rt.publish()
        measured = [d for d in _decisions(tmp_path) if d["step_ms"] is not None]
        assert measured and all(d["step_ms"] == 7.25 for d in measured)
        assert all(d["step_time_source"] == "cuda_events" for d in _decisions(tmp_path))
        snap = json.loads((tmp_path / "rank0.json").read_text())
        assert snap["closed_loop"]["step_time_source"] == "cuda_events"
        assert snap["closed_loop"]["buckets"]["32"]["baseline_ms"] == pytest.approx(7.25)
        text = metrics_text(str(tmp_path))
        assert f'powersave_closed_loop_baseline_step_ms{{bucket="32",gpu="{rt.gpu_id}",timing="cuda_events"}} 7.25' in text
        # Every pair of events goes back to the pool once read; the last step's is read at the next step.
        assert timer.started == 80 and timer.released == 79
    finally:
        rt.close()


def test_steps_still_running_on_the_gpu_wait_and_reach_the_loop_in_step_order(monkeypatch, tmp_path):
    timer = FakeCudaStepTimer(gpu_ms=5.0)
    rt = _gpu_runtime(monkeypatch, tmp_path, lambda device_index: timer)
    seen = []
    orig = rt.clocks.observe_decode_step
    monkeypatch.setattr(rt.clocks, "observe_decode_step", lambda now, batch, *a, **k: (seen.append(batch), orig(now, batch, *a, **k))[1])
    try:
        for b in (8, 9, 10):
            rt.on_step_start(_decode(b))
            rt.on_step_end()
        timer.hold()  # the GPU has not reached these steps' end events yet
        for b in (11, 12):
            rt.on_step_start(_decode(b))
            rt.on_step_end()
        rt.drain_steps()
        assert seen == [8, 9, 10]
        timer.finish()
        for b in (13, 14):  # a step's time is read at a later step's start, on the engine thread
            rt.on_step_start(_decode(b))
            rt.on_step_end()
        rt.drain_steps()
        assert seen == [8, 9, 10, 11, 12, 13]
    finally:
        rt.close()


@pytest.mark.parametrize("where", ["start", "stop", "elapsed_ms"])
def test_a_step_timer_fault_turns_only_the_closed_loop_off_and_steps_stay_metered(monkeypatch, tmp_path, where, caplog):
    monkeypatch.setattr(vllm_compat, "_HOOK_ERRORS", set())  # faults are logged once per process
    caplog.set_level(logging.WARNING, logger="vllm.powersave")  # an earlier test may raise the root level
    rt = _gpu_runtime(monkeypatch, tmp_path, lambda device_index: FakeCudaStepTimer(fail_on=where))
    try:
        for _ in range(30):
            rt.on_step_start(_decode(16))
            rt.on_step_end()
        rt.publish()
        lines = [json.loads(x) for x in (tmp_path / "trace-rank0.jsonl").read_text().splitlines()]
        assert len([x for x in lines if "t" in x]) == 30  # every step traced (step lines, not decisions or ticks)
        assert rt.step_path.timing.active is False
        assert rt.clocks.target_sm_clock_mhz is None  # the decode clock stays at the default
        sv = rt.snapshot()["savings"]["clocks"]
        assert sv["state"] == "failed" and "step timer fault" in sv["why"]
        assert sum(1 for r in caplog.records if f"fake fault in {where}" in r.getMessage()) == 1  # one log line
    finally:
        rt.close()


def test_a_gpu_without_cuda_event_timing_serves_with_the_closed_loop_off_and_one_warning(monkeypatch, tmp_path, caplog):
    def no_events(device_index):
        raise RuntimeError("CUDA is not available")

    caplog.set_level(logging.WARNING, logger="vllm.powersave")  # an earlier test may raise the root level
    rt = _gpu_runtime(monkeypatch, tmp_path, no_events)
    try:
        for _ in range(10):
            rt.on_step_start(_decode(8))
            rt.on_step_end()
        rt.publish()
        assert rt.step_path.timing.active is False and rt.step_time_source == "engine_wall"
        assert not _decisions(tmp_path)  # no decision from launch times
        assert rt.snapshot()["savings"]["clocks"]["state"] == "failed"
        warnings = [r for r in caplog.records if r.levelname == "WARNING" and "CUDA events" in r.getMessage()]
        assert len(warnings) == 1
    finally:
        rt.close()


def test_under_the_simulated_clock_the_loop_learns_the_simulators_step_time(monkeypatch, tmp_path):
    monkeypatch.setattr(vllm_compat, "runner_identity", lambda r: {"rank": 0, "device_type": "cpu", "device_index": None})
    runner = SimpleNamespace(rank=0, scheduler_config=SimpleNamespace(max_num_seqs=64, async_scheduling=False))
    settings = PowersaveSettings.model_validate(
        {
            "stats_dir": str(tmp_path),
            "trace_steps": True,
            "energy": {"idle_after_s": 20.0, "meter": "simulated", "simulated_model_shape": "qwen2.5-7b"},
            "clocks": {"backend": "simulated", "mode": "closed_loop"},
        }
    )
    rt = rt_mod.WorkerRuntime(runner, settings)
    try:
        assert isinstance(rt.step_path.timing.timer, SimulatedStepTimer) and rt.step_time_source == "simulated"
        for _ in range(60):
            rt.on_step_start(_decode(32))
            rt.on_step_end()
        rt.publish()
        measured = [d["step_ms"] for d in _decisions(tmp_path) if d["step_ms"] is not None]
        # A 7B decode step on the simulated H200 takes milliseconds (weights read once); the CPU
        # wall time of this fake step is microseconds.
        assert measured and min(measured) > 1.0
        assert all(d["step_time_source"] == "simulated" for d in _decisions(tmp_path))
    finally:
        rt.close()


def test_the_simulated_timer_reads_nan_for_a_step_it_never_priced():
    t = SimulatedStepTimer()
    m = t.start()
    assert math.isnan(t.elapsed_ms(m))  # no measurement, and not "still running"
    t.set_ms(m, 3.5)
    assert t.elapsed_ms(m) == 3.5


def test_a_closed_loop_fault_also_stops_the_step_timer(monkeypatch, tmp_path):
    timer = FakeCudaStepTimer(gpu_ms=5.0)
    rt = _gpu_runtime(monkeypatch, tmp_path, lambda device_index: timer)

    def boom(*a, **k):
        raise RuntimeError("tuner fault")

    monkeypatch.setattr(rt.clocks, "observe_decode_step", boom)
    try:
        for _ in range(5):
            rt.on_step_start(_decode(8))
            rt.on_step_end()
        rt.drain_steps()
        assert rt.step_path.timing.active is False
        started = timer.started
        for _ in range(50):
            rt.on_step_start(_decode(8))
            rt.on_step_end()
        assert timer.started == started  # no events recorded for a loop that is off
    finally:
        rt.close()


def test_no_cuda_call_leaves_the_engine_thread(monkeypatch, tmp_path):
    """vLLM may capture CUDA graphs on a serving worker; a CUDA call from another thread would
    invalidate the capture. The publisher thread only reads times the engine thread stored."""
    import threading

    class ThreadCheckingTimer(FakeCudaStepTimer):
        def __init__(self, device_index=0):
            super().__init__(device_index, gpu_ms=5.0)
            self.threads = set()

        def start(self):
            self.threads.add(threading.get_ident())
            return super().start()

        def stop(self, mark):
            self.threads.add(threading.get_ident())
            super().stop(mark)

        def elapsed_ms(self, mark):
            self.threads.add(threading.get_ident())
            return super().elapsed_ms(mark)

        def release(self, mark):
            self.threads.add(threading.get_ident())
            super().release(mark)

    timer = ThreadCheckingTimer()
    rt = _gpu_runtime(monkeypatch, tmp_path, lambda device_index: timer)
    try:
        for _ in range(40):
            rt.on_step_start(_decode(8))
            rt.on_step_end()
        done = threading.Event()
        threading.Thread(target=lambda: (rt.publish(), done.set())).start()  # a drain on another thread
        assert done.wait(10)
        assert timer.threads == {threading.get_ident()}
        assert _decisions(tmp_path)  # and the loop still learned from the steps
    finally:
        rt.close()
