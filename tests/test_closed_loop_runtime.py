"""The closed-loop decode clock inside the worker runtime: chosen by the default clocks.mode, fed
by drain_steps from finished steps, its decisions in the step trace and on /metrics."""

import json
from types import SimpleNamespace

from fakes import metrics_text

from vllm_powersave import runtime as rt_mod
from vllm_powersave import vllm_compat
from vllm_powersave.settings import PowersaveSettings


def _decode(n_reqs):
    ids = [f"r{i}" for i in range(n_reqs)]
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=ids, num_computed_tokens=[100] * n_reqs, num_output_tokens=[1] * n_reqs),
        num_scheduled_tokens={i: 1 for i in ids},
        total_num_scheduled_tokens=n_reqs,
        scheduled_spec_decode_tokens={},
        finished_req_ids=set(),
    )


def _cpu_runtime(monkeypatch, tmp_path, **extra):
    monkeypatch.setattr(vllm_compat, "runner_identity", lambda r: {"rank": 0, "device_type": "cpu", "device_index": None})
    runner = SimpleNamespace(rank=0, scheduler_config=SimpleNamespace(max_num_seqs=64, async_scheduling=False))
    settings = PowersaveSettings.model_validate(
        {"stats_dir": str(tmp_path), "trace_steps": True, "energy": {"idle_after_s": 20.0}, **extra}
    )
    return rt_mod.WorkerRuntime(runner, settings)


def test_default_settings_run_the_closed_loop_in_dry_run_and_trace_every_decision(monkeypatch, tmp_path):
    rt = _cpu_runtime(monkeypatch, tmp_path)
    try:
        assert rt.clock_choice.controller == "closed_loop" and rt.clocks.backend.kind == "dry-run"
        for _ in range(120):
            rt.on_step_start(_decode(32))
            rt.on_step_end()
        rt.publish()
        lines = [json.loads(x) for x in (tmp_path / "trace-rank0.jsonl").read_text().splitlines()]
        steps = [x for x in lines if "t" in x]  # step lines, not decisions or energy ticks
        decisions = [x["closed_loop"] for x in lines if "closed_loop" in x]
        assert len(steps) == 120
        assert decisions and decisions[0]["event"] == "bucket"
        assert all(d["step_ms"] is None or d["step_ms"] >= 0 for d in decisions)
        # Dry-run: the loop decides, but every step ran at the default clock and nothing was set.
        assert all(d["ran_at_mhz"] is None for d in decisions if d["event"] != "bucket")
        snap = json.loads((tmp_path / "rank0.json").read_text())
        assert snap["clock_mode"] == "closed_loop"
        assert snap["closed_loop"]["decisions_total"] == len(decisions)
        text = metrics_text(str(tmp_path))
        assert f'powersave_closed_loop_decisions_total{{gpu="{rt.gpu_id}"}} {float(len(decisions))}' in text
        assert "powersave_closed_loop_baseline_step_ms{" in text
    finally:
        rt.close()


def test_presets_or_mode_off_keep_the_closed_loop_out_of_the_step_path(monkeypatch, tmp_path):
    for extra in ({"clocks": {"mode": "off"}}, {"clocks": {"presets": {"decode": {"sm_clock_mhz": 1200}}}}):
        rt = _cpu_runtime(monkeypatch, tmp_path, **extra)
        try:
            assert rt.clocks.closed_loop is None
            for _ in range(20):
                rt.on_step_start(_decode(8))
                rt.on_step_end()
            rt.publish()
            assert not any("closed_loop" in json.loads(x) for x in (tmp_path / "trace-rank0.jsonl").read_text().splitlines())
        finally:
            rt.close()
            (tmp_path / "trace-rank0.jsonl").unlink(missing_ok=True)


def test_a_fault_in_the_closed_loop_turns_only_it_off(monkeypatch, tmp_path):
    rt = _cpu_runtime(monkeypatch, tmp_path)
    try:

        def boom(*a, **k):
            raise RuntimeError("tuner fault")

        monkeypatch.setattr(rt.clocks, "observe_decode_step", boom)
        for _ in range(10):
            rt.on_step_start(_decode(8))
            rt.on_step_end()
        rt.publish()  # drains: the fault is caught there
        lines = (tmp_path / "trace-rank0.jsonl").read_text().splitlines()
        assert len([x for x in lines if "t" in json.loads(x)]) == 10  # steps still traced
        assert rt.closed_loop_active is False
        assert rt.clocks.closed_loop.off_reason == "fault (RuntimeError)"  # the loop's own clocks dropped too
    finally:
        rt.close()
