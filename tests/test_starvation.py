"""Front-end starvation: idle energy while the API server has requests in flight, and its warning."""

import asyncio
import json

from tests.fakes import Clock, metrics_text
from vllm_powersave.energy.account import PhaseEnergyAccount
from vllm_powersave.starvation import BusyTracker, FrontendBusyMiddleware, FrontendBusyReader, StarvationWatch


class Meter:
    """100 W: joules = 100 x the clock's seconds."""

    def __init__(self, clock):
        self.clock = clock

    def energy_j(self):
        return 100.0 * self.clock()

    def on_idle(self, seconds):
        pass


def _account(busy):
    clock = Clock()
    acc = PhaseEnergyAccount(Meter(clock), idle_after_s=0.25, clock=clock, busy=busy)
    acc.on_step("decode", decode_tokens=4, t=0.0)
    acc.on_step_end(t=0.1)
    clock.t = 2.0  # idle from the step's end (0.1 s) to 2.0 s
    acc.tick()
    return acc


def test_idle_with_requests_in_flight_counts_as_idle_while_busy():
    in_flight = [(1.0, 2.0)]  # the API server held a request from 1.0 s on, the engine never saw it
    acc = _account(lambda a, b: sum(max(0.0, min(y, b) - max(x, a)) for x, y in in_flight))
    assert abs(acc.time_s["idle"] - 1.9) < 1e-9
    assert abs(acc.idle_busy_s - 1.0) < 1e-9
    assert abs(acc.idle_busy_j - 100.0) < 1e-6  # 1.0 s of the tick's 2.0 s at 100 W
    assert abs(acc.busy_s - 1.0) < 1e-9
    assert abs(sum(acc.energy_j.values()) - 200.0) < 1e-6  # a subset of idle, not a phase: totals unchanged


def test_idle_with_no_request_in_flight_does_not_count():
    acc = _account(lambda a, b: 0.0)
    assert acc.time_s["idle"] > 1.8
    assert acc.idle_busy_s == 0.0 and acc.idle_busy_j == 0.0 and acc.busy_s == 0.0


def test_busy_while_the_engine_steps_is_not_idle_while_busy():
    acc = _account(lambda a, b: max(0.0, min(b, 0.1) - a))  # busy only while the step ran
    assert acc.idle_busy_s == 0.0 and acc.busy_s > 0


def test_busy_files_of_several_api_servers_are_unioned(tmp_path):
    clock = Clock()
    a = BusyTracker(tmp_path, clock=clock, name="a")
    b = BusyTracker(tmp_path, clock=clock, name="b")
    clock.t = 1.0
    a.enter()
    clock.t = 2.0
    b.enter()
    a.enter()
    clock.t = 3.0
    a.leave()
    a.leave()  # a idle from 3.0
    clock.t = 4.0
    b.leave()  # b busy 2.0-4.0
    clock.t = 6.0
    a.enter()  # open from 6.0
    a.flush()
    b.flush()
    reader = FrontendBusyReader(tmp_path, clock=clock)
    assert reader.overlap(0.0, 10.0) == 3.0 + 4.0  # [1, 4] and [6, 10]
    assert reader.overlap(4.0, 6.0) == 0.0
    assert reader.frontends == 2 and reader.in_flight == 1 and reader.available


def test_reader_without_frontend_files_is_unavailable(tmp_path):
    reader = FrontendBusyReader(tmp_path)
    assert reader.overlap(0.0, 1.0) == 0.0 and not reader.available


def test_middleware_counts_generation_posts_until_the_response_is_sent(tmp_path):
    busy = BusyTracker(tmp_path, name="m")
    seen = []

    async def app(scope, receive, send):
        seen.append(busy.in_flight)

    mw = FrontendBusyMiddleware(app, busy)
    asyncio.run(mw({"type": "http", "method": "POST", "path": "/v1/completions"}, None, None))
    asyncio.run(mw({"type": "http", "method": "GET", "path": "/metrics"}, None, None))
    asyncio.run(mw({"type": "http", "method": "POST", "path": "/powersave/requests/x"}, None, None))
    assert seen == [1, 0, 0] and busy.in_flight == 0 and len(busy.closed) == 1


def test_warning_names_cause_and_fix_once_then_rate_limited():
    clock = Clock(100.0)
    msgs = []

    class Log:
        def warning(self, m):
            msgs.append(m)

    w = StarvationWatch(share=0.05, min_busy_s=30.0, every_s=600.0, clock=clock, logger=Log())
    assert w.check(idle_busy_s=2.0, busy_s=20.0, idle_busy_j=200.0, frontends=1) is None  # too little busy time yet
    assert w.check(idle_busy_s=3.6, busy_s=40.0, idle_busy_j=360.0, frontends=1) is not None  # 9 %
    assert len(msgs) == 1 and "GPU idle 9 % of busy time" in msgs[0] and "--api-server-count 4" in msgs[0]
    clock.t += 60
    assert w.check(idle_busy_s=7.2, busy_s=80.0, idle_busy_j=720.0, frontends=1) is None  # within every_s
    clock.t += 600
    assert w.check(idle_busy_s=10.8, busy_s=120.0, idle_busy_j=1080.0, frontends=4) is not None
    assert "--api-server-count 8 (now 4)" in msgs[-1] and len(msgs) == 2


def test_warning_stays_silent_below_the_threshold():
    w = StarvationWatch(share=0.05, min_busy_s=30.0, every_s=600.0, clock=Clock())
    assert w.check(idle_busy_s=0.3, busy_s=60.0, idle_busy_j=30.0, frontends=1) is None
    assert w.warnings == 0


def test_metrics_export_idle_while_busy_counters_per_gpu_and_engine(tmp_path):
    snap = {
        "pid": 1,
        "rank": 0,
        "engine": 0,
        "gpu": "GPU-a",
        "source": "measured",
        "energy_available": True,
        "energy_method": "energy-counter",
        "energy_j": {"decode": 50.0, "idle": 20.0},
        "time_s": {},
        "steps": {},
        "tokens": {},
        "idle_while_busy_j": 12.5,
        "idle_while_busy_s": 0.25,
        "frontend_busy_s": 3.0,
        "savings": {"perf_boost": {"state": "auto", "basis": "measured", "why": "x"}},
    }
    (tmp_path / "rank0.json").write_text(json.dumps(snap))
    text = metrics_text(tmp_path)
    assert 'powersave_idle_while_busy_energy_joules_total{engine="0",gpu="GPU-a",source="measured"} 12.5' in text
    assert 'powersave_idle_while_busy_seconds_total{engine="0",gpu="GPU-a"} 0.25' in text
    assert 'powersave_frontend_busy_seconds_total{engine="0",gpu="GPU-a"} 3.0' in text
    assert 'powersave_saving_state{basis="measured",gpu="GPU-a",saving="perf_boost",state="auto"} 1.0' in text
    del snap["idle_while_busy_j"]
    (tmp_path / "rank0.json").write_text(json.dumps(snap))
    assert "powersave_idle_while_busy_energy_joules_total{" not in metrics_text(tmp_path)  # absent, not zero


def test_loadtests_report_reads_idle_while_busy_from_the_server_metrics():
    from loadtests.energy import EnergyReading, Sample, parse_scrape, starvation_over
    from loadtests.metrics import energy_metrics
    from loadtests.report import compare_table, format_table

    text = (
        "# TYPE powersave_idle_while_busy_energy_joules counter\n"
        'powersave_idle_while_busy_energy_joules_total{engine="0",gpu="g0",source="measured"} 30.0\n'
        'powersave_idle_while_busy_energy_joules_total{engine="0",gpu="g1",source="measured"} 10.0\n'
        "# TYPE powersave_idle_while_busy_seconds counter\n"
        'powersave_idle_while_busy_seconds_total{engine="0",gpu="g0"} 1.0\n'
        "# TYPE powersave_frontend_busy_seconds counter\n"
        'powersave_frontend_busy_seconds_total{engine="0",gpu="g0"} 20.0\n'
    )
    sc = parse_scrape(text)
    assert (sc.idle_while_busy_j, sc.idle_while_busy_s, sc.frontend_busy_s) == (40.0, 1.0, 20.0)
    r = EnergyReading(energy_j=500.0, source="measured", by_phase_j={"idle": 60.0})
    starvation_over(
        [
            Sample(t=0, idle_while_busy_j=10.0, idle_while_busy_s=0.5, frontend_busy_s=5.0),
            Sample(t=1, idle_while_busy_j=40.0, idle_while_busy_s=1.0, frontend_busy_s=20.0),
        ],
        r,
    )
    m = energy_metrics(r, 100, 1000)
    assert m["gpu_idle_while_busy_energy_j"] == 30.0 and abs(m["idle_while_busy_share"] - 0.5 / 15.0) < 1e-12
    res = {"label": "x", **m}
    assert "idle while requests in flight (J)" in format_table(res)
    table = compare_table({"off": res, "on": {**res, "gpu_idle_while_busy_energy_j": None, "idle_while_busy_share": None}})
    assert "| of which idle while requests in flight (J total) | 30.0 (measured) |" in table
    assert "| Engine idle while requests in flight (% of busy time, wall clock) | 3.3 | n/a |" in table


def test_a_window_that_opens_before_the_starvation_series_exist_counts_from_zero():
    from loadtests.energy import EnergyReading, Sample, starvation_over

    end = Sample(t=9, counters={(): 1.0}, idle_while_busy_j=12.0, idle_while_busy_s=0.5, frontend_busy_s=8.0)
    r = EnergyReading(energy_j=500.0, source="measured")
    starvation_over([Sample(t=0, counters={(): 0.0}), end], r)  # metrics read at the start, no series yet
    assert (r.idle_while_busy_j, r.idle_while_busy_s, r.frontend_busy_s) == (12.0, 0.5, 8.0)
    failed = EnergyReading(energy_j=500.0, source="measured")
    starvation_over([Sample(t=0, counters=None), end], failed)  # the first read failed: unknown, not 0
    assert failed.idle_while_busy_j is None


def test_worker_books_idle_while_the_api_server_holds_requests_and_not_after(monkeypatch, tmp_path):
    import time
    from types import SimpleNamespace

    from tests.test_energy_runtime import sched
    from vllm_powersave import runtime as rt_mod
    from vllm_powersave import vllm_compat
    from vllm_powersave.settings import PowersaveSettings

    monkeypatch.setattr(vllm_compat, "runner_identity", lambda r: {"rank": 0, "device_type": "cpu", "device_index": None})
    runner = SimpleNamespace(rank=0, scheduler_config=SimpleNamespace(max_num_seqs=8, async_scheduling=False))
    api = BusyTracker(tmp_path, name="api")
    api.enter()  # a request the engine never got
    api.flush()
    rt = rt_mod.WorkerRuntime(
        runner,
        PowersaveSettings.model_validate(
            {
                "stats_dir": str(tmp_path),
                "energy": {"meter": "simulated", "simulated_model_shape": "qwen2.5-0.5b", "idle_after_s": 0.05, "tick_s": 0.05},
            }
        ),
    )
    try:
        rt.on_step_start(sched({"a": 1}))
        rt.on_step_end()
        time.sleep(0.4)  # the engine idles while the API server holds the request
        rt.account.tick()
        busy = rt.snapshot()
        assert busy["idle_while_busy_s"] > 0.2 and busy["idle_while_busy_j"] > 0 and busy["frontends"] == 1
        api.leave()
        api.flush()
        time.sleep(0.1)  # let the reader's refresh period pass
        rt.account.tick()
        before = rt.snapshot()
        time.sleep(0.3)  # idle with nothing in flight
        rt.account.tick()
        after = rt.snapshot()
        assert after["idle_while_busy_s"] == before["idle_while_busy_s"]
        assert after["energy_j"]["idle"] > before["energy_j"]["idle"]
        assert "powersave_idle_while_busy_energy_joules_total{" in metrics_text(tmp_path)
    finally:
        rt.close()


def test_starvation_watch_off_leaves_the_middleware_out_and_keeps_request_energy():
    from vllm_powersave import api_server_middleware
    from vllm_powersave.settings import load_settings

    on = api_server_middleware(load_settings({}, env={}))
    off = api_server_middleware(load_settings({"energy": {"starvation_watch": False}, "per_request_energy": True}, env={}))
    assert on == ["vllm_powersave.starvation.FrontendBusyMiddleware"]
    assert off and all("starvation" not in m for m in off)
