"""Closed-loop decode clock: target held, convergence, back-off, safety, dry-run (fake NVML and simulated GPU)."""

import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fakes import FakeNvml

from vllm_powersave.clocks import ClockController, DryRunClockBackend, LeaseStore, NvmlClockBackend
from vllm_powersave.device import NvmlGpu
from vllm_powersave.settings import SettingsError, load_settings
from vllm_powersave.sim.gpu import H200, misfit
from vllm_powersave.sim.trace import serving_trace
from vllm_powersave.tune.replay import compare, replay

TESTS = Path(__file__).parent
REPO = TESTS.parent
F_MAX = 1980
#: A bucket that holds a clock: plain holding, or re-checking it against the default clock.
HOLDING = ("hold", "check")


class H200Nvml(FakeNvml):
    """The fake NVML with the H200's 110 supported SM clocks (docs/h200-facts.md)."""

    def nvmlDeviceGetSupportedGraphicsClocks(self, h, mem):
        return list(H200.sm_clocks_mhz)


def _settings(tmp_path, **cl):
    c = {
        "backend": "nvml",
        "min_dwell_ms": 0,
        "switch_latency_ms": 1.0,
        "lease_dir": str(tmp_path / "leases"),
        "closed_loop": {"enabled": True, **cl},
    }
    return load_settings({"clocks": c}, env={}).clocks


class Gpu:
    """A fake GPU's true decode step time: memory-bound above ``knee_mhz``, ∝ 1/f below it."""

    def __init__(self, nvml, knee_mhz, noise=0.0, seed=0):
        self.nvml, self.knee, self.noise, self.rng = nvml, knee_mhz, noise, random.Random(seed)

    def clock(self):
        return self.nvml.locked[0] if self.nvml.locked else F_MAX

    def slowdown(self, f):
        return max(1.0, self.knee / f) - 1.0

    def step_ms(self, ctx):
        base = 8.0 + 4e-5 * ctx  # weights plus KV reads: grows with the context
        return base * (1 + self.slowdown(self.clock())), self.rng.gauss(1.0, self.noise) if self.noise else 1.0


def _drive(ctl, gpu, steps, t, ctx, batch=64, log=None):
    """Run ``steps`` decode steps; returns (t, ctx). ``log`` collects each step's true slowdown."""
    for _ in range(steps):
        ctl.on_phase("decode", t)
        f = gpu.clock()
        ms, noise = gpu.step_ms(ctx)
        t += ms / 1e3
        if log is not None:
            log.append((f, gpu.slowdown(f)))
        ctl.observe_decode_step(t, batch, ms * noise, True, ctx)
        t += 0.0005
        ctx += batch // 8
    return t, ctx


def _lowest_ok(gpu, budget=0.01):
    return min(c for c in H200.sm_clocks_mhz if gpu.slowdown(c) <= budget + 1e-12)


@pytest.mark.parametrize("error", [0.0, 0.3, -0.3])
def test_converges_to_lowest_clock_within_budget_under_noise_and_misfit(tmp_path, error):
    nvml = H200Nvml()
    ctl = ClockController(NvmlClockBackend(NvmlGpu(nvml, "h0")), _settings(tmp_path), gpu_id="GPU-c", asynchronous=False, watchdog=False)
    gpu = Gpu(nvml, 780 * (1 + error), noise=0.01, seed=3)
    log = []
    _drive(ctl, gpu, 12_000, 0.0, 30_000, log=log)
    b = ctl.closed_loop.snapshot()["buckets"][64]
    held = b["held_mhz"]
    assert b["state"] in HOLDING and held is not None
    # Converged: within the budget, and no more than the search resolution above the lowest clock that is.
    assert gpu.slowdown(held) <= 0.01
    assert held <= _lowest_ok(gpu) + ctl.settings.closed_loop.resolution_mhz + 15
    assert b["probes"] <= ctl.settings.closed_loop.max_probes_per_bucket
    # The target holds for >= 99 % of decode steps, probes included.
    assert sum(s <= 0.01 + 1e-12 for _, s in log) / len(log) >= 0.99
    ctl.close()
    assert nvml.locked is None


def test_measured_violation_backs_off_within_the_bound(tmp_path):
    nvml = H200Nvml()
    s = _settings(tmp_path, backoff_steps=6, rebaseline_s=0, reprobe_after_s=0)
    ctl = ClockController(NvmlClockBackend(NvmlGpu(nvml, "h0")), s, gpu_id="GPU-v", asynchronous=False, watchdog=False)
    gpu = Gpu(nvml, 780)
    t, ctx = _drive(ctl, gpu, 6000, 0.0, 30_000)
    held = ctl.closed_loop.snapshot()["buckets"][64]["held_mhz"]
    assert held is not None and nvml.locked == (held, held)
    gpu.knee = held * 1.05  # the GPU now runs 5 % slower at the held clock (e.g. thermals)
    steps = 0
    while nvml.locked and nvml.locked[0] <= held:
        t, ctx = _drive(ctl, gpu, 1, t, ctx)
        steps += 1
        assert steps <= 50
    # Detected within backoff_steps measured steps (+1: the step that carries the switch).
    assert steps <= s.closed_loop.backoff_steps + 1
    assert [r.event for r in ctl.closed_loop.records].count("violation") == 1
    _drive(ctl, gpu, 6000, t, ctx)
    b = ctl.closed_loop.snapshot()["buckets"][64]
    assert b["state"] in HOLDING and (b["held_mhz"] is None or (b["held_mhz"] > held and gpu.slowdown(b["held_mhz"]) <= 0.01))
    ctl.close()


def test_compute_bound_steps_keep_the_default_clock(tmp_path):
    nvml = H200Nvml()
    ctl = ClockController(NvmlClockBackend(NvmlGpu(nvml, "h0")), _settings(tmp_path), gpu_id="GPU-p", asynchronous=False, watchdog=False)
    gpu = Gpu(nvml, 780)
    t, ctx = _drive(ctl, gpu, 6000, 0.0, 30_000)
    assert nvml.locked is not None  # decode runs at a lower clock
    decode_target = ctl._all_targets["decode"]
    ctl.on_phase("prefill", t)
    assert nvml.locked is None  # raised at once for the compute-bound step
    assert ctl.observe_decode_step(t + 0.05, 8, 50.0, memory_bound=False) is None
    assert ctl._all_targets["decode"] == decode_target  # a compute-bound step is no decode measurement
    ctl.close()


def test_dry_run_records_decisions_and_sets_nothing(tmp_path):
    nvml = FakeNvml(no_permission=True)  # no privilege: the controller falls back to dry-run
    ctl = ClockController(NvmlClockBackend(NvmlGpu(nvml, "h0")), _settings(tmp_path), gpu_id="GPU-d", asynchronous=False, watchdog=False)
    gpu = Gpu(nvml, 780)
    t, ctx = 0.0, 30_000
    for _ in range(60):
        t, ctx = _drive(ctl, gpu, 50, t, ctx)
        assert nvml.locked is None
    assert ctl.backend.kind == "dry-run"
    events = [r.event for r in ctl.closed_loop.records]
    assert "baseline_done" in events and "probe" in events and "unmeasured" in events
    assert "accept" not in events  # no step ran at a probe clock, so none was measured as passing
    assert ctl.decisions  # the clock decisions were computed and recorded
    sets = [c for c in ctl.backend.calls if c[0] == "set"]
    assert sets and nvml.locked is None
    ctl.close()


def test_pure_dry_run_backend_reports_baseline_step_times(tmp_path):
    s = load_settings({"clocks": {"backend": "dry-run", "min_dwell_ms": 0, "closed_loop": {"enabled": True}}}, env={}).clocks
    be = DryRunClockBackend()
    ctl = ClockController(be, s, asynchronous=False, watchdog=False)
    nvml = FakeNvml()  # never handed to the controller: stands for the GPU at its default clock
    t, _ = _drive(ctl, Gpu(nvml, 780), 200, 0.0, 30_000)
    done = [r for r in ctl.closed_loop.records if r.event == "baseline_done"]
    assert done and done[0].spread_pct is not None and "default-clock steps" in done[0].reason
    ctl.close()


def test_static_decode_preset_overrides_the_loop(tmp_path):
    nvml = H200Nvml()
    s = load_settings(
        {
            "clocks": {
                "backend": "nvml",
                "min_dwell_ms": 0,
                "lease_dir": str(tmp_path / "l"),
                "presets": {"decode": {"sm_clock_mhz": 900}},
                "closed_loop": {"enabled": True},
            }
        },
        env={},
    ).clocks
    ctl = ClockController(NvmlClockBackend(NvmlGpu(nvml, "h0")), s, gpu_id="GPU-o", asynchronous=False, watchdog=False)
    assert ctl.closed_loop is None
    ctl.on_phase("decode", 0.0)
    assert ctl.observe_decode_step(0.01, 64, 10.0) is None and nvml.locked == (900, 900)
    ctl.close()
    assert nvml.locked is None


def test_close_resets_a_closed_loop_lock_and_releases_the_lease(tmp_path):
    nvml = FakeNvml()
    ctl = ClockController(NvmlClockBackend(NvmlGpu(nvml, "h0")), _settings(tmp_path), gpu_id="GPU-x", asynchronous=False, watchdog=False)
    _drive(ctl, Gpu(nvml, 780), 3000, 0.0, 30_000)
    assert nvml.locked is not None and LeaseStore(tmp_path / "leases").held("GPU-x")
    ctl.close()
    ctl.close()
    assert nvml.locked is None and LeaseStore(tmp_path / "leases").all() == []
    assert ctl.observe_decode_step(100.0, 64, 10.0) is None  # closed: no further decisions


CHILD = textwrap.dedent("""
    import sys, time
    sys.path[:0] = [{tests!r}, {repo!r}]
    from fakes import FakeNvml
    from vllm_powersave.clocks import ClockController, NvmlClockBackend
    from vllm_powersave.device import NvmlGpu
    from vllm_powersave.settings import load_settings
    nvml = FakeNvml(state_file={state!r})
    s = load_settings({{"clocks": {{"backend": "nvml", "min_dwell_ms": 0, "switch_latency_ms": 1, "lease_dir": {leases!r},
                        "closed_loop": {{"enabled": True}}}}}}, env={{}}).clocks
    ctl = ClockController(NvmlClockBackend(NvmlGpu(nvml, "h0")), s, gpu_id="GPU-k", asynchronous=False, watchdog=False)
    t, ctx = 0.0, 30000
    while nvml.locked is None:
        ctl.on_phase("decode", t)
        t += 0.01
        ctl.observe_decode_step(t, 64, 10.0, True, ctx)
        ctx += 8
    print("locked", nvml.locked[0], flush=True)
    time.sleep(60)
""")


def test_sigkill_during_a_probe_lock_is_recovered_at_next_start(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=str(TESTS), repo=str(REPO), state=str(tmp_path / "gpu.json"), leases=str(tmp_path / "leases")))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    assert line[:1] == ["locked"], proc.stderr.read()
    proc.kill()
    proc.wait()
    gpu, leases = FakeNvml(state_file=tmp_path / "gpu.json"), LeaseStore(tmp_path / "leases")
    assert gpu.locked == (int(line[1]), int(line[1])) and [lease["pid"] for lease in leases.stale()] == [proc.pid]
    nxt = ClockController(NvmlClockBackend(NvmlGpu(gpu, "h0")), _settings(tmp_path), gpu_id="GPU-k", asynchronous=False, watchdog=False)
    assert gpu.locked is None and leases.all() == []
    nxt.close()


def test_nvml_fault_stops_the_loop_and_resets(tmp_path):
    nvml = FakeNvml()
    ctl = ClockController(NvmlClockBackend(NvmlGpu(nvml, "h0")), _settings(tmp_path), gpu_id="GPU-f", asynchronous=False, watchdog=False)
    gpu = Gpu(nvml, 780)
    t, ctx = _drive(ctl, gpu, 3000, 0.0, 30_000)
    nvml.inject("nvmlDeviceSetGpuLockedClocks", 15, times=None)  # GpuIsLost from now on
    nvml.inject("nvmlDeviceResetGpuLockedClocks", 15, times=1)
    ctl.closed_loop.reset(t, "test: model changed")  # forces new probes, i.e. new set calls
    _drive(ctl, gpu, 3000, t, ctx)
    assert ctl.disabled_reason is not None
    assert ctl.observe_decode_step(t + 100, 64, 10.0) is None
    ctl.close()
    assert nvml.locked is None


def test_bad_closed_loop_setting_is_one_line_naming_the_field():
    with pytest.raises(SettingsError) as err:
        load_settings({"clocks": {"closed_loop": {"slowdown_budget_pct": -1}}}, env={})
    assert "clocks.closed_loop.slowdown_budget_pct" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(SettingsError, match="batch_buckets"):
        load_settings({"clocks": {"closed_loop": {"batch_buckets": [4, 4]}}}, env={})


def test_replay_closed_loop_keeps_the_budget_where_the_static_preset_breaks_it():
    # Simulated: a GPU whose clock response is 30 % stronger than the model behind the 900 MHz preset.
    spec = misfit(H200, 0.3)
    trace = serving_trace(90.0, 11, H200)
    common = {"backend": "simulated", "min_dwell_ms": 20, "compute_share_max": 0.0, "presets": {"idle": {"sm_clock_mhz": 345}}}
    stock = load_settings({"clocks": {"backend": "simulated"}}, env={}).clocks
    static = load_settings(
        {"clocks": {**common, "presets": {"decode": {"sm_clock_mhz": 900}, "idle": {"sm_clock_mhz": 345}}}}, env={}
    ).clocks
    loop = load_settings({"clocks": {**common, "closed_loop": {"enabled": True}}}, env={}).clocks
    base = replay(trace, spec, stock, noise_sigma=0.01)
    r_static = compare(base, replay(trace, spec, static, noise_sigma=0.01))
    r_loop = compare(base, replay(trace, spec, loop, noise_sigma=0.01))
    assert r_static["slo_attainment"] < 0.9  # the model-predicted preset is too low for this GPU
    assert r_loop["slo_attainment"] >= 0.99
    assert r_loop["decode_energy_ratio"] < 0.95 and r_loop["throughput_ratio"] > 0.99


def test_tpot_slo_target_keeps_decode_steps_under_the_slo(tmp_path):
    nvml = H200Nvml()
    # Default-clock steps take 9.2 ms growing to 10 ms with the context; a 10.5 ms TPOT SLO leaves
    # room for a clock below the memory-bound knee, less and less as the context grows.
    ctl = ClockController(
        NvmlClockBackend(NvmlGpu(nvml, "h0")), _settings(tmp_path, tpot_slo_ms=10.5), gpu_id="GPU-slo", asynchronous=False, watchdog=False
    )
    gpu = Gpu(nvml, 780, noise=0.005, seed=5)
    t, ctx, late = 0.0, 30_000, []
    for _ in range(2500):
        f = gpu.clock()
        late.append((8.0 + 4e-5 * ctx) * (1 + gpu.slowdown(f)) > 10.5)
        t, ctx = _drive(ctl, gpu, 1, t, ctx)
    b = ctl.closed_loop.snapshot()["buckets"][64]
    assert b["state"] in HOLDING and b["held_mhz"] is not None and b["held_mhz"] < _lowest_ok(gpu)  # the SLO allows more than 1 %
    assert sum(late) / len(late) <= 0.01
    ctl.close()


def test_a_loop_stopped_by_a_fault_leaves_no_clock_of_its_own_applied(tmp_path):
    nvml = H200Nvml()
    ctl = ClockController(NvmlClockBackend(NvmlGpu(nvml, "h0")), _settings(tmp_path), gpu_id="GPU-f", asynchronous=False, watchdog=False)
    gpu = Gpu(nvml, 780, noise=0.01, seed=3)
    t, ctx = _drive(ctl, gpu, 12_000, 0.0, 30_000)
    for _ in range(100):  # until the held clock is the one applied (not a reference window's default)
        if nvml.locked is not None:
            break
        t, ctx = _drive(ctl, gpu, 10, t, ctx)
    held = ctl.closed_loop.snapshot()["buckets"][64]["held_mhz"]
    assert held is not None and nvml.locked is not None  # a lower clock is held and applied
    ctl.stop_closed_loop(t, "fault (RuntimeError)")  # what the drain does when feeding the loop fails
    ctl.on_phase("decode", t + 2.0)
    assert nvml.locked is None  # decode back at the driver's default: nothing tracks a lower clock now
    assert ctl.closed_loop.snapshot()["buckets"][64]["held_mhz"] is None
    ctl.close()
