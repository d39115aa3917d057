"""The energy layer inside a worker (WorkerRuntime) with a fake NVML: faults at every NVML call,
multi-GPU (TP ranks) sums, and the per-request attribution invariant."""

import json
import logging
import random
import sys
from types import SimpleNamespace

import pytest
from fakes import Clock, FakeNvmlDevices, metrics_text

from vllm_powersave import runtime as rt_mod
from vllm_powersave import vllm_compat
from vllm_powersave.device import NvmlGpu
from vllm_powersave.energy import PhaseEnergyAccount
from vllm_powersave.energy.meters import NvmlEnergyMeter
from vllm_powersave.request_energy import RequestEnergyIndex
from vllm_powersave.settings import PowersaveSettings
from vllm_powersave.sim.gpu import H200

CODES = {"NotSupported": 3, "NoPermission": 4, "GpuIsLost": 15, "Unknown": 999}


class Warnings(logging.Handler):
    """Counts WARNING+ records of the plugin's loggers (vLLM may stop propagation to root)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def warnings_seen():
    h = Warnings()
    lg = logging.getLogger("vllm.powersave")
    old = lg.level
    lg.addHandler(h)
    lg.setLevel(logging.DEBUG)
    yield h.records
    lg.removeHandler(h)
    lg.setLevel(old)


def sched(reqs, finished=()):
    """A decode step's SchedulerOutput (the fields vllm_compat reads)."""
    ids = list(reqs)
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=ids, num_computed_tokens=[10] * len(ids), num_output_tokens=[1] * len(ids)),
        num_scheduled_tokens=dict(reqs),
        total_num_scheduled_tokens=sum(reqs.values()),
        scheduled_spec_decode_tokens={},
        finished_req_ids=set(finished),
    )


def make_runtime(monkeypatch, tmp_path, nvml, rank=0, visible="GPU-bbbb-1111", **extra):
    monkeypatch.setitem(sys.modules, "pynvml", nvml)  # the runtime's NVML init (runtime.NVML) imports it
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(vllm_compat, "runner_identity", lambda r: {"rank": r.rank, "device_type": "cuda", "device_index": 0})
    runner = SimpleNamespace(rank=rank, scheduler_config=SimpleNamespace(max_num_seqs=2, async_scheduling=False))
    # idle_after_s 20: the background publisher (period 0.5 s) stays out of the way; the test ticks.
    # gauge_period_s 0: gauges re-read at every publish, so a fault shows at once (default: 2 s).
    settings = PowersaveSettings.model_validate(
        {
            "stats_dir": str(tmp_path),
            "per_request_energy": True,
            "energy": {"idle_after_s": 20.0, "gauge_period_s": 0.0, "tick_s": 0.05},
            **extra,
        }
    )
    return rt_mod.WorkerRuntime(runner, settings)


def scrape(stats_dir):
    out = {}
    for line in metrics_text(stats_dir).splitlines():
        if line.startswith("powersave_"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def run_steps(rt, nvml, n=6):
    for i in range(n):
        rt.on_step_start(sched({"a": 1, "b": 1}, finished=("x",) if i == 0 else ()))
        nvml.energy_mj = [e + 30_000 for e in nvml.energy_mj]
        rt.on_step_end()
        rt.account.tick()
    rt.on_step_start(sched({"b": 1}, finished=("a",)))
    rt.on_step_end()
    rt.account.tick()
    rt.publish()


# call -> what a fault there affects
MATRIX = {
    "nvmlDeviceGetTotalEnergyConsumption": "energy",
    "nvmlDeviceGetFieldValues": "instant-power",
    "nvmlDeviceGetPowerUsage": "power",
    "nvmlDeviceGetClockInfo": "clocks",
    "nvmlDeviceGetTemperature": "temperature",
    "nvmlDeviceGetCurrentClocksEventReasons": "reasons",
}


@pytest.mark.parametrize("when", ["start", "running"])
@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("call", MATRIX)
def test_fault_at_every_nvml_call_serving_continues_one_warning(monkeypatch, tmp_path, warnings_seen, call, code, when):
    # PowerUsage is only read where the instant-power field is missing.
    nvml = FakeNvmlDevices(uuids=("GPU-aaaa-0000", "GPU-bbbb-1111"), instant=call != "nvmlDeviceGetPowerUsage")
    if when == "start":
        nvml.faults[call] = CODES[code]
    runtime = make_runtime(monkeypatch, tmp_path, nvml)
    try:
        assert runtime.gpu_id == "GPU-bbbb-1111"  # CUDA_VISIBLE_DEVICES=GPU-bbbb-1111 -> NVML device 1
        run_steps(runtime, nvml, 2)
        if when == "running":
            nvml.faults[call] = CODES[code]
        run_steps(runtime, nvml, 4)  # serving continues: no exception from the hooks, ticks or publishing
        m = scrape(tmp_path)
        lines = [json.loads(x) for x in (tmp_path / "requests-rank0.jsonl").read_text().splitlines()]
    finally:
        runtime.close()
    what = MATRIX[call]
    capability = code == "NotSupported" and what in ("instant-power", "clocks", "temperature", "reasons")
    assert len(warnings_seen) == (0 if capability else 1), [r.getMessage() for r in warnings_seen]
    gpu = 'gpu="GPU-bbbb-1111"'
    energy_series = [k for k in m if k.startswith("powersave_gpu_energy_joules_total{")]
    if what == "energy" and not (when == "start" and code == "NotSupported"):
        # unavailable: the gauge says so, and no energy figure is published (none frozen)
        method = "energy-counter" if when == "running" else "none"
        assert m[f'powersave_energy_available{{{gpu},method="{method}"}}'] == 0.0
        assert not energy_series and not any(k.startswith(("powersave_engine_energy", "powersave_tokens_per_joule")) for k in m)
        assert [x["energy_j"] for x in lines if x["request_id"] == "a"][-1] is None  # finished after the fault
    elif what == "energy":  # no counter at start: power sampling, labelled
        assert m[f'powersave_energy_available{{{gpu},method="power-sampling"}}'] == 1.0
        assert energy_series and all('method="power-sampling"' in k and 'source="measured"' in k for k in energy_series)
    else:
        assert m[f'powersave_energy_available{{{gpu},method="energy-counter"}}'] == 1.0
        assert sum(m[k] for k in energy_series) > 0
        assert [x["energy_j"] > 0 for x in lines if x["request_id"] == "a"] == [True, True]
    power = f'powersave_gpu_power_watts{{{gpu},source="measured"}}'
    if what == "power":
        assert power not in m
    elif what != "energy":
        assert m[power] == 250.0  # the instant field, or the average where it fails
    present = {
        "clocks": "powersave_sm_clock_mhz{" + gpu,
        "temperature": "powersave_gpu_temperature_celsius{" + gpu,
        "reasons": "powersave_clock_event_reasons{" + gpu,
    }
    for w, prefix in present.items():
        assert any(k.startswith(prefix) for k in m) == (w != what), w


def test_nvml_init_or_device_lookup_failing_marks_energy_unavailable(monkeypatch, tmp_path, warnings_seen):
    for faults in ({"nvmlInit": 999}, {"nvmlDeviceGetHandleByUUID": 15, "nvmlDeviceGetCount": 15}):
        warnings_seen.clear()
        nvml = FakeNvmlDevices(uuids=("GPU-aaaa-0000", "GPU-bbbb-1111"))
        nvml.faults.update(faults)
        (tmp_path / str(len(faults))).mkdir()
        runtime = make_runtime(monkeypatch, tmp_path / str(len(faults)), nvml)
        try:
            run_steps(runtime, nvml, 3)
            m = scrape(tmp_path / str(len(faults)))
        finally:
            runtime.close()
        assert len(warnings_seen) == 1, [r.getMessage() for r in warnings_seen]
        assert m['powersave_energy_available{gpu="cuda0-rank0",method="none"}'] == 0.0  # never the simulated H200
        assert m['powersave_steps_total{gpu="cuda0-rank0",phase="decode"}'] == 4.0  # serving went on
        assert not any(k.startswith("powersave_gpu_energy_joules_total") for k in m)


def test_tensor_parallel_ranks_sum_to_engine_and_requests(monkeypatch, tmp_path):
    """Two fake GPUs (TP=2: same steps, different power): engine = sum of ranks, per request too."""
    nvml = [FakeNvmlDevices(uuids=("GPU-aaaa-0000", "GPU-bbbb-1111")) for _ in range(2)]
    rts = [make_runtime(monkeypatch, tmp_path, nvml[r], rank=r, visible=("GPU-aaaa-0000", "GPU-bbbb-1111")[r]) for r in range(2)]
    try:
        steps = [({"r1": 64}, ()), ({"r1": 1, "r2": 32}, ()), ({"r1": 1, "r2": 1}, ()), ({"r2": 1}, ("r1",)), ({}, ("r2",))]
        for reqs, fin in steps:
            for r, rt in enumerate(rts):  # every rank gets the same scheduler output
                rt.on_step_start(sched(reqs, fin))
                nvml[r].energy_mj = [e + (40_000 if r == 0 else 25_000) for e in nvml[r].energy_mj]
                rt.on_step_end()
                rt.account.tick()
        for rt in rts:
            # The background publisher keeps ticking the account (and the fake counter's interpolation
            # keeps adding energy): stop it, so the scrape and the accounts below are one moment.
            rt.stop_publisher_thread()
            rt.account.tick()
            rt.publish()
        m = scrape(tmp_path)
        acc = [rt.account for rt in rts]
        # energy of no request (idle, the tail after the last step) as published with the scrape
        idle = sum(a.energy_j["idle"] + a.tail_j + a.pending_j for a in acc)
    finally:
        for rt in rts:
            rt.close()
    per_gpu = {}
    for k, v in m.items():
        if k.startswith("powersave_gpu_energy_joules_total{"):
            g = k.split('gpu="')[1].split('"')[0]
            per_gpu[g] = per_gpu.get(g, 0.0) + v
    engine = sum(v for k, v in m.items() if k.startswith("powersave_engine_energy_joules_total{"))
    assert set(per_gpu) == {"GPU-aaaa-0000", "GPU-bbbb-1111"}
    assert engine == pytest.approx(per_gpu["GPU-aaaa-0000"] + per_gpu["GPU-bbbb-1111"], rel=1e-9)
    assert per_gpu["GPU-aaaa-0000"] > per_gpu["GPU-bbbb-1111"] > 0
    idx = RequestEnergyIndex(tmp_path)
    idx.refresh()
    req = {r: idx.lookup(r) for r in ("r1", "r2")}
    for r in ("r1", "r2"):
        assert req[r]["status"] == "complete" and req[r]["ranks_reported"] == 2
        assert req[r]["energy_j"] == pytest.approx(sum(req[r]["gpus"].values()), abs=1e-5)
    # per rank and summed over ranks: requests + idle + tail (+ the open gap) == total
    for a in acc:
        assert a.finished_request_j + sum(a.request_j.values()) + a.energy_j["idle"] + a.tail_j + a.pending_j == pytest.approx(
            a.total_j(), rel=1e-9
        )
    total_req = req["r1"]["energy_j"] + req["r2"]["energy_j"]
    assert total_req + idle == pytest.approx(engine, rel=0.01)
    assert m['powersave_tokens_per_joule{kind="total",source="measured",window="run"}'] == pytest.approx(
        (64 + 33 + 2 + 1) / engine, rel=1e-6
    )  # tokens counted once, energy of both GPUs
    # max_num_seqs = 2: the steps with two requests are the steady state (33 + 2 tokens)
    for g in ("GPU-aaaa-0000", "GPU-bbbb-1111"):
        assert sum(v for k, v in m.items() if k.startswith(f'powersave_steady_tokens_total{{gpu="{g}"')) == 35
    steady_j = sum(v for k, v in m.items() if k.startswith("powersave_steady_energy_joules_total{"))
    assert 0 < steady_j < engine
    assert m['powersave_tokens_per_joule{kind="total",source="measured",window="steady"}'] == pytest.approx(35 / steady_j, rel=1e-6)


def test_requests_plus_idle_equal_measured_total_within_1_percent_with_interpolation():
    """A random serving trace on an interpolating counter meter with a 100 ms counter: the
    attribution sums to the account total exactly and to the GPU's true energy within 1 %."""
    rng = random.Random(3)
    clock = Clock()
    nvml = FakeNvmlDevices(power_w=200.0)
    true_j = [0.0]
    t_upd = [0.0]

    def advance(dt, watts):
        # the counter steps every 100 ms to the energy up to that step
        nvml.power_mw[0] = int(watts * 1000)
        end = clock.t + dt
        while t_upd[0] + 0.1 <= end:
            true_j[0] += watts * (t_upd[0] + 0.1 - max(clock.t, t_upd[0]))
            clock.t = max(clock.t, t_upd[0])
            t_upd[0] += 0.1
            clock.t = t_upd[0]
            nvml.energy_mj[0] = 1_000_000 + int(true_j[0] * 1000)
        true_j[0] += watts * (end - clock.t)
        clock.t = end

    meter = NvmlEnergyMeter(NvmlGpu(nvml, 0, "g"), clock=clock)
    done = {}
    acc = PhaseEnergyAccount(meter, idle_after_s=0.25, clock=clock, per_request=True, on_request_done=lambda r, j: done.__setitem__(r, j))
    running, finished, n, next_tick = {}, [], 0, 0.125
    t_start_true = true_j[0]
    while clock.t < 40:
        if rng.random() < 0.05 or not running:
            n += 1
            running[f"q{n}"] = rng.randint(50, 400)  # prompt tokens first
        step = {r: (tok if tok > 1 else 1) for r, tok in running.items()}
        acc.on_step("mixed" if any(v > 1 for v in step.values()) else "decode", req_tokens=step, finished=finished)
        finished = []
        advance(rng.uniform(0.01, 0.04), rng.choice([250.0, 400.0, 600.0]))
        acc.on_step_end()
        for r in list(running):
            running[r] = 1 if running[r] > 1 else running[r]
            if rng.random() < 0.03:
                finished.append(r)
                del running[r]
        if rng.random() < 0.02:
            advance(rng.uniform(0.3, 1.5), 90.0)  # idle gap
        if clock.t >= next_tick:
            acc.tick()
            next_tick = clock.t + rng.uniform(0.1, 0.15)
    acc.on_finished(set(running) | set(finished))
    advance(0.3, 90.0)
    acc.tick()
    assert len(done) == n and not acc.request_j
    total = acc.total_j()
    assert sum(done.values()) + acc.energy_j["idle"] == pytest.approx(total, rel=1e-9)
    assert total == pytest.approx(true_j[0] - t_start_true, rel=0.01)


def test_gauges_are_read_once_per_gauge_period(monkeypatch, tmp_path):
    """Power/clock/extras cost NVML reads (milliseconds each on some hosts): at most one set per
    gauge_period_s, however often the publisher runs."""
    nvml = FakeNvmlDevices(uuids=("GPU-aaaa-0000", "GPU-bbbb-1111"))
    reads = []
    orig = nvml.nvmlDeviceGetClockInfo
    monkeypatch.setattr(nvml, "nvmlDeviceGetClockInfo", lambda h, k: reads.append(k) or orig(h, k))
    # idle_after_s 20: the background publisher stays out; the runtime's first publish reads the gauges.
    runtime = make_runtime(monkeypatch, tmp_path, nvml, energy={"idle_after_s": 20.0, "gauge_period_s": 60.0, "tick_s": 0.05})
    try:
        for _ in range(5):
            runtime.publish()
        assert len(reads) == 2  # SM + memory clock, once
        assert json.loads((tmp_path / "rank0.json").read_text())["sm_clock_mhz"] is not None
    finally:
        runtime.close()


def test_snapshot_says_what_the_meter_learnt_of_the_counter(monkeypatch, tmp_path):
    """The counter's period and the reads that contradicted its phase are in the snapshot, so a
    run's raw files show how well its counter steps were placed (docs/request-energy.md)."""
    nvml = FakeNvmlDevices(uuids=("GPU-aaaa-0000", "GPU-bbbb-1111"))
    runtime = make_runtime(monkeypatch, tmp_path, nvml)
    try:
        run_steps(runtime, nvml)
        snap = json.loads((tmp_path / "rank0.json").read_text())
        assert snap["counter_period_s"] == runtime.meter.period > 0
        assert snap["counter_phase_losses"] == runtime.meter.phase_losses
    finally:
        runtime.close()


def test_snapshot_reports_the_workers_peak_cuda_allocation(monkeypatch, tmp_path):
    # What LM-head chunking lowers for prompt-logprob batches; read from PyTorch's allocator stats.
    import torch

    asked, resets = [], []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda dev: asked.append(dev) or 7_340_032)
    # The peak of vLLM's start-up profile run, warm-up and graph capture must not be reported as
    # serving's: reset once, at the first served step (not at a warm-up step), on this worker's device.
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda dev: resets.append(dev))
    rt = make_runtime(monkeypatch, tmp_path, FakeNvmlDevices(uuids=("GPU-aaaa-0000", "GPU-bbbb-1111")))
    try:
        assert resets == []
        assert rt.snapshot()["cuda_peak_scope"].startswith("since worker start")
        rt.on_step_start(sched({"_warmup_0_": 16, "_warmup_1_": 1}))  # V2's kernel warm-up
        rt.on_step_end()
        assert resets == []
        rt.on_step_start(sched({"cmpl-1": 1}))
        rt.on_step_end()
        assert resets == [0]
        snap = rt.snapshot()
        assert snap["cuda_peak_allocated_bytes"] == 7_340_032
        assert snap["cuda_peak_scope"] == "since the first served step"
        assert resets == [0]  # publishing never resets again
        assert asked and set(asked) == {0}  # the device index of this worker (the publisher may ask too)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda dev: (_ for _ in ()).throw(RuntimeError("no CUDA")))
        assert rt.snapshot()["cuda_peak_allocated_bytes"] is None  # never breaks the snapshot
    finally:
        rt.close()
    monkeypatch.setattr(vllm_compat, "runner_identity", lambda r: {"rank": 0, "device_type": "cpu", "device_index": None})
    cpu = rt_mod.WorkerRuntime(
        SimpleNamespace(rank=0, scheduler_config=SimpleNamespace(max_num_seqs=2, async_scheduling=False)),
        PowersaveSettings.model_validate({"stats_dir": str(tmp_path / "cpu"), "energy": {"meter": "off"}}),
    )
    try:
        assert cpu.snapshot()["cuda_peak_allocated_bytes"] is None
        assert cpu.snapshot()["cuda_peak_scope"] is None
        assert resets == [0]  # a CPU worker never touches CUDA statistics
    finally:
        cpu.close()


def test_peak_reset_failure_keeps_the_runtime_and_says_what_the_peak_covers(monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda dev: 5 << 30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda dev: (_ for _ in ()).throw(RuntimeError("no CUDA")))
    rt = make_runtime(monkeypatch, tmp_path, FakeNvmlDevices(uuids=("GPU-aaaa-0000", "GPU-bbbb-1111")))
    try:
        rt.on_step_start(sched({"cmpl-1": 1}))
        rt.on_step_end()
        snap = rt.snapshot()
        assert snap["cuda_peak_allocated_bytes"] == 5 << 30
        assert snap["cuda_peak_scope"].startswith("since worker start")
    finally:
        rt.close()


def test_trace_and_simulator_count_prompt_logprob_rows(monkeypatch, tmp_path):
    # The LM-head chunking case: a 4000-token prompt with prompt_logprobs sends 3999 rows through
    # the LM head, not one; the step trace (and the simulated GPU's pricing) must say so.
    monkeypatch.setattr(vllm_compat, "runner_identity", lambda r: {"rank": 0, "device_type": "cpu", "device_index": None})
    runner = SimpleNamespace(rank=0, scheduler_config=SimpleNamespace(max_num_seqs=8, async_scheduling=False))
    rt = rt_mod.WorkerRuntime(
        runner,
        PowersaveSettings.model_validate(
            {"stats_dir": str(tmp_path), "trace_steps": True, "energy": {"meter": "off", "idle_after_s": 20.0}}
        ),
    )
    try:
        new = SimpleNamespace(
            req_id="p", prompt_token_ids=list(range(4000)), num_computed_tokens=0, sampling_params=SimpleNamespace(prompt_logprobs=1)
        )
        first = SimpleNamespace(
            scheduled_new_reqs=[new],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[], num_output_tokens=[]),
            num_scheduled_tokens={"p": 2048},
            total_num_scheduled_tokens=2048,
            scheduled_spec_decode_tokens={},
            finished_req_ids=set(),
        )
        second = SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(req_ids=["p"], num_computed_tokens=[2048], num_output_tokens=[0]),
            num_scheduled_tokens={"p": 1952},
            total_num_scheduled_tokens=1952,
            scheduled_spec_decode_tokens={},
            finished_req_ids=set(),
        )
        third = sched({"p": 1})
        for so in (first, second, third):
            rt.on_step_start(so)
            rt.on_step_end()
        rt.publish()
        lines = [json.loads(x) for x in (tmp_path / "trace-rank0.jsonl").read_text().splitlines()]
        rows = [x["rows"] for x in lines if "t" in x]  # step lines, not the closed loop's decisions or energy ticks
        assert rows[:2] == [1 + 2048, 1 + 1951]  # the sampling row plus the prompt positions of the chunk
    finally:
        rt.close()


def test_warmup_steps_are_neither_traced_nor_metered(monkeypatch, tmp_path):
    # V2's kernel warm-up runs execute_model with its own requests before serving starts.
    nvml = FakeNvmlDevices(uuids=("GPU-aaaa-0000", "GPU-bbbb-1111"))
    rt = make_runtime(monkeypatch, tmp_path, nvml)
    try:
        for _ in range(3):
            rt.on_step_start(sched({"_v2_mixed_warmup_0": 64, "_v2_mixed_warmup_1": 1}))
            rt.on_step_end()
        assert sum(rt.account.steps.values()) == 0
        rt.on_step_start(sched({"cmpl-a": 1}))
        rt.on_step_end()
        rt.drain_steps()  # the step hook only records; the account is fed in batches
        assert rt.account.steps["decode"] == 1
        # vLLM 0.32 warms kernels up again on a serving worker (elastic-EP scale-up): such steps are
        # left out after the first served step too (recognised by the drain here: no presets).
        rt.on_step_start(sched({"_warmup_0_": 1}))
        rt.on_step_end()
        rt.drain_steps()
        assert rt.account.steps["decode"] == 1
        rt.on_step_start(sched({"cmpl-b": 1}))
        rt.on_step_end()
        rt.drain_steps()
        assert rt.account.steps["decode"] == 2
    finally:
        rt.close()


def test_prompt_logprob_rows_are_read_only_where_they_can_be_nonzero(monkeypatch, tmp_path):
    """PromptLogprobRows is asked only when a request is pending or the step has context-phase
    (new) requests, and only where the rows are read (the step trace, the simulator)."""
    nvml = FakeNvmlDevices(uuids=("GPU-aaaa-0000", "GPU-bbbb-1111"))
    rt = make_runtime(monkeypatch, tmp_path, nvml, trace_steps=True)
    calls = []
    orig = rt.drain.plp_rows.rows
    monkeypatch.setattr(rt.drain.plp_rows, "rows", lambda so: calls.append(1) or orig(so))
    try:
        for _ in range(4):  # decode-only steps, nothing pending: never asked
            rt.on_step_start(sched({"a": 1, "b": 1}))
            rt.on_step_end()
        rt.drain_steps()
        assert calls == [] and rt.account.steps["decode"] == 4
        rt.drain.plp_rows.left["a"] = 3  # a request with prompt-logprob rows still to come: asked
        rt.on_step_start(sched({"a": 1, "b": 1}))
        rt.on_step_end()
        rt.drain_steps()
        assert calls == [1] and rt.drain.plp_rows.left == {"a": 2}
    finally:
        rt.close()


def test_real_gpu_without_nvml_use_is_labelled_cuda_not_simulated(monkeypatch, tmp_path):
    """Meter off and dry-run clocks on a CUDA device: no NVML is opened, and the GPU label must not
    read like the simulated GPU's ("sim0"); on a machine without CUDA it stays "sim0"."""
    monkeypatch.setattr(vllm_compat, "runner_identity", lambda r: {"rank": r.rank, "device_type": "cuda", "device_index": 1})
    runner = SimpleNamespace(rank=0, scheduler_config=SimpleNamespace(max_num_seqs=2, async_scheduling=False))
    settings = PowersaveSettings.model_validate({"stats_dir": str(tmp_path), "energy": {"meter": "off"}, "clocks": {"backend": "dry-run"}})
    rt = rt_mod.WorkerRuntime(runner, settings)
    try:
        assert rt.gpu_id == "cuda1-rank0"
        assert rt.meter is None and rt.sim is None
    finally:
        rt.close()
    # Simulated figures keep the simulated GPU's label, on a CUDA device too.
    sim = PowersaveSettings.model_validate({"stats_dir": str(tmp_path), "energy": {"meter": "simulated"}, "clocks": {"backend": "dry-run"}})
    rt = rt_mod.WorkerRuntime(runner, sim)
    try:
        assert rt.gpu_id == "sim0" and rt.sim is not None
    finally:
        rt.close()
    monkeypatch.setattr(vllm_compat, "runner_identity", lambda r: {"rank": r.rank, "device_type": "cpu", "device_index": None})
    rt = rt_mod.WorkerRuntime(runner, settings)
    try:
        assert rt.gpu_id == "sim0"
    finally:
        rt.close()


def _random_steps(rng, n_steps):
    """SchedulerOutputs of a random serving run: new requests (some with prompt_logprobs), chunked
    prefills, decodes, finished ids, steps that schedule nothing."""
    out, live, next_id = [], {}, 0
    for _ in range(n_steps):
        new, nst = [], {}
        if rng.random() < 0.3:
            for _ in range(rng.randint(1, 3)):
                rid = f"r{next_id}"
                next_id += 1
                plen = rng.randint(2, 40)
                sp = SimpleNamespace(prompt_logprobs=1 if rng.random() < 0.5 else None)
                new.append(SimpleNamespace(req_id=rid, sampling_params=sp, prompt_token_ids=list(range(plen)), num_computed_tokens=0))
                nst[rid] = rng.randint(1, plen)
                live[rid] = plen - nst[rid]
        cached = [r for r in live if r not in nst]
        ctx = []
        for r in cached:
            if live[r] > 0:  # prompt still to prefill: a chunk of it
                take = rng.randint(1, live[r])
                live[r] -= take
                nst[r] = take
                ctx.append(0)
            else:
                nst[r] = 1
                ctx.append(rng.randint(1, 5))
        finished = set()
        for r in list(cached):
            if rng.random() < 0.1:
                finished.add(r)
                del live[r]
                del nst[r]
                ctx.pop(cached.index(r))
                cached.remove(r)
        if rng.random() < 0.08:
            new, cached, ctx, nst = [], [], [], {}
        out.append(
            SimpleNamespace(
                scheduled_new_reqs=new,
                scheduled_cached_reqs=SimpleNamespace(
                    req_ids=cached, num_computed_tokens=[rng.randint(5, 500) for _ in cached], num_output_tokens=ctx
                ),
                num_scheduled_tokens=nst,
                total_num_scheduled_tokens=sum(nst.values()),
                scheduled_spec_decode_tokens={},
                finished_req_ids=finished,
            )
        )
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_step_records_drained_in_batches_equal_feeding_every_step(monkeypatch, tmp_path, seed):
    """The step hook appends a record and drain_steps feeds the account, the trace and the
    prompt-logprob rows later, in batches (at random points, also while a step runs, and with
    steps whose end never comes): the account's events and counts and the trace lines equal
    those of feeding every step at once, to the bit, on the same clock."""
    rng = random.Random(seed)
    steps = _random_steps(rng, 300)
    plan = [(rng.random() < 0.05, rng.random() < 0.1, rng.random() < 0.1) for _ in steps]  # (no end, drain mid-step, drain after)
    results = []
    for inline in (True, False):
        tick = [1000.0]

        def mono():
            tick[0] += 0.001
            return tick[0]

        clock = SimpleNamespace(monotonic=mono, time=lambda: 0.0)
        for part in (rt_mod.step, rt_mod.publisher):  # every module of the runtime on this clock
            monkeypatch.setattr(part, "time", clock)
        d = tmp_path / ("inline" if inline else "batched")
        d.mkdir()
        nvml = FakeNvmlDevices(uuids=("GPU-aaaa-0000", "GPU-bbbb-1111"))
        rt = make_runtime(monkeypatch, d, nvml, trace_steps=True, clocks={"presets": {"decode": {"sm_clock_mhz": 1200}}})
        rt.stop_publisher_thread()  # this test drains; the publisher thread stays out
        rt.step_path.drain_inline = inline
        events = []
        try:
            for so, (no_end, mid, after) in zip(steps, plan):
                rt.on_step_start(so)
                if mid and not inline:
                    rt.drain_steps()
                if not no_end:
                    rt.on_step_end()
                if after and not inline:
                    rt.drain_steps()
                    events.extend(rt.account._events)
                    rt.account._events.clear()
            rt.drain_steps(final=True)
            events.extend(rt.account._events)
            rt.account._events.clear()
            rt.publisher.flush_trace(final=True)
            acc = rt.account
            results.append(
                (
                    events,
                    dict(acc.steps),
                    dict(acc.tokens),
                    dict(acc.steady_tokens),
                    dict(rt.drain.plp_rows.left),
                    (d / "trace-rank0.jsonl").read_text(),
                )
            )
        finally:
            rt.step_path.drain_inline = True
            rt.close()
    inline_r, batched_r = results
    assert len(inline_r[0]) > 300 and inline_r[5].count("\n") > 200
    assert inline_r[1]["prefill"] >= 3 and inline_r[1]["mixed"] > 10 and inline_r[1]["decode"] > 10 and inline_r[1]["idle"] == 0
    for a, b in zip(inline_r, batched_r):
        assert a == b


def test_empty_steps_do_not_move_the_end_of_the_last_batchs_work(monkeypatch, tmp_path):
    """vLLM runs empty steps (nothing scheduled) while it waits; they report finished requests
    only. Their ends are no work's end: a batch with a request never reported would otherwise
    never reach idle_after_s while they run (docs/request-energy.md)."""
    nvml = FakeNvmlDevices(uuids=("GPU-aaaa-0000", "GPU-bbbb-1111"))
    rt = make_runtime(monkeypatch, tmp_path, nvml)
    calls = []
    monkeypatch.setattr(rt.account, "on_step_end", lambda t=None: calls.append("end"))
    monkeypatch.setattr(rt.account, "on_finished", lambda fin, t=None: calls.append(set(fin)))
    try:
        rt.on_step_start(sched({"a": 1, "b": 1}))
        rt.on_step_end()
        for fin in ({"a"}, (), ()):  # "a" reported; "b" never (aborted without a report)
            rt.on_step_start(sched({}, finished=fin))
            rt.on_step_end()
        rt.on_step_start(sched({"c": 1}))  # the next step's record makes the empty ones final
        rt.drain_steps()
        assert calls == ["end", {"a"}, set(), set()]
    finally:
        rt.close()


def test_the_simulated_gpu_prices_a_decode_pacing_hold_as_idle_time(monkeypatch, tmp_path):
    # The simulated GPU prices each step's modelled work and leaves the host's gaps free; a hold of
    # the decode pacer is GPU idle time a real GPU pays loaded-idle power for (docs/decode-pacing.md).
    from vllm_powersave.pacing import PaceFigures

    monkeypatch.setattr(vllm_compat, "runner_identity", lambda r: {"rank": 0, "device_type": "cpu", "device_index": None})
    runner = SimpleNamespace(rank=0, scheduler_config=SimpleNamespace(max_num_seqs=8, async_scheduling=False))
    settings = {"stats_dir": str(tmp_path), "energy": {"meter": "simulated", "simulated_model_shape": "qwen2.5-7b", "idle_after_s": 0.25}}

    def run(held_s):
        rt = rt_mod.WorkerRuntime(runner, PowersaveSettings.model_validate(settings))
        try:
            for i, held in enumerate(held_s):
                so = sched({"a": 1, "b": 1})
                setattr(so, vllm_compat.PACING_ATTR, PaceFigures(35.0, i, held, 0))
                rt.on_step_start(so)
                rt.on_step_end()
            rt.drain_steps(final=True)
            return rt.sim.energy_j, rt.snapshot()["decode_pacing"]
        finally:
            rt.close()

    unpaced_j, _ = run([0.0, 0.0, 0.0, 0.0])
    paced_j, snap = run([0.0, 0.03, 0.06, 0.06 + 0.9])  # two 30 ms holds, then one longer than idle_after_s
    assert paced_j - unpaced_j == pytest.approx(H200.p_idle_w * (0.03 + 0.03 + 0.25), rel=1e-9)
    assert snap == {
        "tpot_target_ms": 35.0,
        "held_steps": 3,
        "held_s": pytest.approx(0.96),
        "woken_early": 0,
        "paused": 0,
        "closed_loop_pauses": 0,
        "pauses_withdrawn": 0,
        "closed_loop_checks": 0,
        "checking": 0,
    }
