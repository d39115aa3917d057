"""cuda_perf_boost "auto": the side-context booster (BoostHolder protocol, BoostController hysteresis)."""

from __future__ import annotations

import json
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from vllm_powersave.clocks.boost import BoostController, BoostHolder, BoostUnavailable


class FakeHolder:
    """Records hold/release calls; ``set`` blocks until ``gate`` opens, like a context creation."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[bool] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail = fail
        self.closed = False
        self.done = threading.Event()

    def set(self, hold: bool) -> float:
        self.gate.wait(5)
        if self.fail:
            self.done.set()
            raise BoostUnavailable("no CUDA driver")
        self.calls.append(hold)
        self.done.set()
        return 12.5

    def close(self) -> None:
        self.closed = True


def _settle(ctl: BoostController, holder: FakeHolder, n: int) -> None:
    for _ in range(500):
        if len(holder.calls) >= n and not ctl._ev.is_set():
            return
        time.sleep(0.01)
    raise AssertionError(f"expected {n} calls, got {holder.calls}")


def test_hold_on_first_busy_step_release_after_idle_dwell():
    h = FakeHolder()
    t = [100.0]
    ctl = BoostController(h, release_after_s=2.0, clock=lambda: t[0])
    try:
        ctl.on_busy()
        _settle(ctl, h, 1)
        assert h.calls == [True] and ctl.held
        for dt in (0.5, 1.0, 1.9):  # busy steps keep it; idle shorter than the dwell keeps it
            t[0] += dt
            ctl.on_busy()
            ctl.tick()
        t[0] += 1.99
        ctl.tick()
        time.sleep(0.05)
        assert h.calls == [True]
        t[0] += 0.02  # 2.01 s since the last step
        ctl.tick()
        _settle(ctl, h, 2)
        assert h.calls == [True, False] and not ctl.held
        assert ctl.snapshot() == {"held": False, "switches": 2, "last_switch_ms": 12.5, "disabled": None}
        # Each finished switch once, on the injected clock, for the step trace.
        assert [tuple(x) for x in ctl.drain_switches()] == [(100.0, True, 12.5), (t[0], False, 12.5)]
        assert ctl.drain_switches() == []
    finally:
        ctl.close()
    assert h.closed


def test_hot_path_never_waits_for_the_context():
    h = FakeHolder()
    h.gate.clear()  # the context creation "hangs"
    ctl = BoostController(h, release_after_s=1.0)
    try:
        for _ in range(1000):
            ctl.on_busy()  # returns although set() is blocked on the background thread
        assert h.calls == [] and ctl.want
        h.gate.set()
        _settle(ctl, h, 1)
        assert h.calls == [True]  # 1000 busy steps: one hold
    finally:
        ctl.close()


def test_failure_disables_with_one_warning_and_no_exception(caplog):
    h = FakeHolder(fail=True)
    ctl = BoostController(h, release_after_s=1.0)
    try:
        with caplog.at_level("WARNING", logger="vllm_powersave"):
            ctl.on_busy()
            assert h.done.wait(5)
            for _ in range(100):
                if ctl.disabled_reason:
                    break
                time.sleep(0.01)
            ctl.want = False
            ctl.on_busy()  # disabled: no new attempt
            time.sleep(0.05)
        assert ctl.disabled_reason == "no CUDA driver" and not ctl.held
        assert sum("side context failed" in r.message for r in caplog.records) == 1
    finally:
        ctl.close()


class ScriptHolder(BoostHolder):
    """BoostHolder talking to a stand-in helper (the real one needs libcuda)."""

    def __init__(self, script: str) -> None:
        super().__init__("GPU-fake", timeout_s=5)
        self.script = script

    def _start(self):
        import subprocess

        return subprocess.Popen([sys.executable, "-c", self.script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)


ECHO = "import sys\nfor line in sys.stdin:\n    print('ok 3.25', flush=True)\n"


def test_holder_protocol_no_op_and_close():
    h = ScriptHolder(ECHO)
    assert h.set(True) == 3.25 and h.held
    assert h.set(True) == 0.0  # already held: no round trip
    assert h.set(False) == 3.25 and not h.held
    proc = h._proc
    h.close()
    assert proc.poll() is not None  # EOF on stdin ends the helper (and would drop its context)


def test_holder_reports_helper_errors_and_stays_off():
    h = ScriptHolder("import sys\nsys.stdin.readline(); print('err cuInit returned CUDA error 100', flush=True)\n")
    with pytest.raises(BoostUnavailable, match="CUDA error 100"):
        h.set(True)
    assert not h.held and h.broken
    with pytest.raises(BoostUnavailable):
        h.set(True)  # broken holders do not retry on the hot path's behalf


def test_real_helper_without_a_driver_fails_cleanly():
    h = BoostHolder("GPU-none", timeout_s=20)
    try:
        import ctypes

        ctypes.CDLL("libcuda.so.1")
        pytest.skip("a CUDA driver is present")
    except OSError:
        pass
    with pytest.raises(BoostUnavailable, match="no CUDA driver"):
        h.set(True)


def test_auto_mode_sets_the_variable_and_is_validated():
    import os

    from vllm_powersave import apply_process_env
    from vllm_powersave.settings import ENV_PERF_BOOST, SettingsError, load_settings

    s = load_settings({"cuda_perf_boost": "auto", "boost_release_after_s": 5}, env={})
    old = os.environ.pop(ENV_PERF_BOOST, None)
    try:
        apply_process_env(s)
        assert os.environ[ENV_PERF_BOOST] == "1"
    finally:
        os.environ.pop(ENV_PERF_BOOST, None)
        if old is not None:
            os.environ[ENV_PERF_BOOST] = old
    with pytest.raises(SettingsError, match="boost_release_after_s"):
        load_settings({"boost_release_after_s": 0}, env={})


def test_worker_runtime_auto_mode_drives_the_booster(monkeypatch, tmp_path):
    """Inside a worker (fake NVML GPU): busy steps hold the boost off the hot path, idle releases
    it, /metrics shows it, close() drops the context."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from fakes import FakeNvmlDevices, metrics_text
    from test_energy_runtime import sched

    from vllm_powersave import runtime as rt_mod
    from vllm_powersave import vllm_compat
    from vllm_powersave.settings import PowersaveSettings

    holders: list[FakeHolder] = []
    # The controller's clock is the steps' (time.monotonic) moved ahead by the test: the publisher
    # thread's ticks cannot release the boost on their own during a stall of the test host (the
    # dwell is 30 s), only once the test moves the clock past it.
    ahead = [0.0]

    def fake_boost_for(on_gpu, gpu_id, release_after_s):
        assert on_gpu and gpu_id.startswith("GPU-")
        holders.append(FakeHolder())
        return BoostController(holders[-1], release_after_s, clock=lambda: time.monotonic() + ahead[0])

    nvml = FakeNvmlDevices(["GPU-bbbb-1111"])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb-1111")
    monkeypatch.setattr(vllm_compat, "runner_identity", lambda r: {"rank": 0, "device_type": "cuda", "device_index": 0})
    monkeypatch.setattr(rt_mod.build, "boost_for", fake_boost_for)  # construction picks the booster (looked up at build time)
    runner = SimpleNamespace(rank=0, scheduler_config=SimpleNamespace(max_num_seqs=2, async_scheduling=False))
    settings = PowersaveSettings.model_validate(
        {
            "stats_dir": str(tmp_path),
            "cuda_perf_boost": "auto",
            "boost_release_after_s": 30.0,
            "trace_steps": True,
            "energy": {"idle_after_s": 20.0},
        }
    )
    rt = rt_mod.WorkerRuntime(runner, settings)
    try:
        for _ in range(5):
            rt.on_step_start(sched({"a": 1, "b": 1}))
            rt.on_step_end()
        _settle(rt.boost, holders[0], 1)
        assert holders[0].calls == [True]
        ahead[0] = 30.5  # 30.5 s without a step
        rt.boost.tick()
        _settle(rt.boost, holders[0], 2)
        assert holders[0].calls == [True, False]
        rt.publish()
        text = metrics_text(tmp_path)
        assert 'powersave_cuda_boost_switches_total{gpu="GPU-bbbb-1111"} 2.0' in text
        assert 'powersave_cuda_boost_held{gpu="GPU-bbbb-1111"} 0.0' in text
        assert 'cuda_perf_boost="auto"' in text
        # The step trace carries the hold and the release, after the steps that caused them.
        lines = [json.loads(x) for x in (tmp_path / "trace-rank0.jsonl").read_text().splitlines()]
        boost = [x["boost"] for x in lines if "boost" in x]
        steps = [x for x in lines if "t" in x]
        assert [b["held"] for b in boost] == [True, False]
        assert boost[0]["t_s"] >= steps[0]["t"] and boost[1]["t_s"] >= steps[-1]["t_end"]
    finally:
        rt.close()
    assert holders[0].closed


class MortalHolder(FakeHolder):
    """A FakeHolder whose helper can die while holding (``living`` False until the next ``set``),
    and whose release can fail (``fail_release``)."""

    def __init__(self) -> None:
        super().__init__()
        self.living = True
        self.fail_release = False

    def alive(self) -> bool:
        return self.living

    def set(self, hold: bool) -> float:
        if not hold and self.fail_release:
            raise BoostUnavailable("boost helper: BrokenPipeError")
        self.living = True  # a hold after a death starts a new helper
        return super().set(hold)


def _drained(ctl: BoostController, n: int) -> list[tuple]:
    got: list[tuple] = []
    for _ in range(500):
        got += [(x.held, x.ms) for x in ctl.drain_switches()]
        if len(got) >= n:
            return got
        time.sleep(0.01)
    raise AssertionError(f"expected {n} switches, got {got}")


def test_a_boost_lost_without_a_release_is_traced_as_a_release_without_a_helper_time():
    """The trace's boost lines must say when the GPU lost the boost: a helper that died holding, a
    release that failed, and close() while holding end it as surely as a release does."""
    t = [100.0]
    h = MortalHolder()
    ctl = BoostController(h, release_after_s=2.0, clock=lambda: t[0])
    try:
        ctl.on_busy()
        assert _drained(ctl, 1) == [(True, 12.5)]
        h.living = False  # OOM-killed while holding: its context, and the boost, went with it
        ctl.tick()
        assert _drained(ctl, 2) == [(False, None), (True, 12.5)]  # noticed, then held again
    finally:
        ctl.close()  # while held: the helper is ended
    assert [(x.held, x.ms) for x in ctl.drain_switches()] == [(False, None)]

    h = MortalHolder()
    ctl = BoostController(h, release_after_s=2.0, clock=lambda: t[0])
    try:
        ctl.on_busy()
        assert _drained(ctl, 1) == [(True, 12.5)]
        h.fail_release = True  # the release fails: the holder ends its helper, and the boost
        t[0] += 2.5
        ctl.tick()
        assert _drained(ctl, 1) == [(False, None)] and ctl.disabled_reason and not ctl.held
    finally:
        ctl.close()
    assert ctl.drain_switches() == []  # released already: close() adds nothing
