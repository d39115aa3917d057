"""The /metrics collector against broken rank snapshots: not JSON, not an object, wrong types,
NaN, infinite or negative figures, leftovers of dead writers, a missing stats dir. /metrics (vLLM's
own series included) must keep answering, never export NaN or negative counters, and never sum
engine figures over a subset of ranks."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_powersave import metrics
from vllm_powersave.metrics import PowersaveCollector

GOOD = {
    "gpu": "GPU-a",
    "rank": 0,
    "pid": os.getpid(),
    "source": "simulated",
    "clock_backend": "simulated",
    "energy_available": True,
    "energy_method": "model",
    "energy_j": {"prefill": 1.5, "decode": 2.0, "idle": 10.0},
    "steps": {"prefill": 3, "decode": 40},
    "tokens": {"prefill": 300, "decode": 40},
    "power_w": 300.0,
    "sm_clock_mhz": 1200,
    "clock_changes": 4,
}


@pytest.fixture
def warnings_seen():
    """Warnings of the plugin's logger, caught on the logger itself: once vLLM is imported (by any
    earlier test) its logging setup stops "vllm.*" records from reaching pytest's root handler."""
    seen: list[str] = []

    class H(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    lg = logging.getLogger("vllm.powersave")
    h, old = H(logging.WARNING), lg.level
    lg.addHandler(h)
    lg.setLevel(logging.WARNING)
    yield seen
    lg.removeHandler(h)
    lg.setLevel(old)


def scrape(d) -> str:
    reg = CollectorRegistry()
    Counter("vllm_own_requests", "a series of vLLM's own", registry=reg).inc()
    reg.register(PowersaveCollector(d, "t"))
    return generate_latest(reg).decode()


def samples(text: str) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


BAD = [
    ("[1, 2]", "not a JSON object"),
    ("5", "not a JSON object"),
    ('"text"', "not a JSON object"),
    ('{"gpu": "GPU-b", "energy_available": true, "energy_j": {"decode": "abc"}}', "'energy_j'"),
    ('{"gpu": "GPU-b", "energy_available": true, "energy_j": {"decode": NaN}}', "'energy_j'"),
    ('{"gpu": "GPU-b", "energy_available": true, "energy_j": {"decode": Infinity}}', "'energy_j'"),
    ('{"gpu": "GPU-b", "energy_available": true, "energy_j": {"decode": -5.0}}', "'energy_j'"),
    ('{"gpu": "GPU-b", "energy_available": true, "energy_j": [1]}', "'energy_j'"),
    ('{"gpu": "GPU-b", "power_w": "x"}', "'power_w'"),
    ('{"gpu": "GPU-b", "power_w": NaN}', "'power_w'"),
    ('{"gpu": "GPU-b", "clock_changes": -1}', "'clock_changes'"),
    ('{"gpu": "GPU-b", "steps": [1]}', "'steps'"),
    ('{"gpu": "GPU-b", "tokens": {"decode": true}}', "'tokens'"),
    ('{"gpu": "GPU-b", "cuda_boost": "yes"}', "'cuda_boost'"),
    ('{"gpu": "GPU-b", "cuda_boost": {"held": true, "switches": NaN}}', "'cuda_boost'"),
    ('{"gpu": "GPU-b", "decode_pacing": {"held_s": "long"}}', "'decode_pacing'"),
    ('{"gpu": "GPU-b", "decode_pacing": [1]}', "'decode_pacing'"),
    ('{"gpu": ["GPU-b"]}', "'gpu'"),
    ('{"gpu": "GPU-b", "energy_available": true, "window": {"seconds": 5, "energy_j": NaN}}', "'window'"),
    ('{"gpu": "GPU-b", "energy_available": true, "steady": {"seconds": 5, "tokens": {"decode": -3}}}', "'steady.tokens'"),
    ('{"gpu": "GPU-b", "temperature_c": Infinity}', "'temperature_c'"),
    ('{"half a fi', "not JSON"),
]


@pytest.mark.parametrize("content,why", BAD)
def test_a_broken_rank_snapshot_never_breaks_metrics(tmp_path, warnings_seen, content, why):
    (tmp_path / "rank0.json").write_text(json.dumps(GOOD))
    (tmp_path / "rank1.json").write_text(content)
    text = scrape(tmp_path)
    scrape(tmp_path)
    got = samples(text)
    assert got[("vllm_own_requests_total", ())] == 1.0  # vLLM's own series still served
    assert (
        got[("powersave_gpu_energy_joules_total", (("gpu", "GPU-a"), ("method", "model"), ("phase", "decode"), ("source", "simulated")))]
        == 2.0
    )
    assert all(math.isfinite(v) for v in got.values())  # no NaN or infinity
    assert not [k for k, v in got.items() if k[0].endswith("_total") and v < 0]
    assert not [k for k in got if k[0] == "powersave_engine_energy_joules_total"]  # rank 1's energy is unknown: no partial sum
    assert not [k for k in got if dict(k[1]).get("gpu") == "GPU-b" and k[0] != "powersave_energy_available"]
    unavailable = [k for k, v in got.items() if k[0] == "powersave_energy_available" and v == 0.0]
    assert len(unavailable) == 1 and dict(unavailable[0][1])["gpu"] in ("GPU-b", "rank1")
    warnings = [m for m in warnings_seen if "rank1.json" in m]
    assert len(warnings) == 1 and why in warnings[0]  # once per file and reason, naming what is wrong


def test_leftovers_of_dead_writers_are_ignored_fresh_or_live_ones_kept(tmp_path):
    (tmp_path / "rank0.json").write_text(json.dumps(GOOD))
    left = tmp_path / "rank1.json"
    left.write_text(json.dumps({**GOOD, "gpu": "GPU-old", "rank": 1, "pid": dead_pid()}))
    past = time.time() - 3600
    os.utime(left, (past, past))
    got = samples(scrape(tmp_path))
    assert not [k for k in got if dict(k[1]).get("gpu") == "GPU-old"]
    assert got[("powersave_engine_energy_joules_total", (("phase", "decode"), ("source", "simulated")))] == 2.0
    # The same file written just now (a Ray relay writes snapshots of workers on other nodes,
    # whose PIDs mean nothing here): kept, and summed.
    os.utime(left, None)
    got = samples(scrape(tmp_path))
    assert got[("powersave_engine_energy_joules_total", (("phase", "decode"), ("source", "simulated")))] == 4.0
    # Old but its writer alive (a worker stuck in a long step): kept.
    left.write_text(json.dumps({**GOOD, "gpu": "GPU-old", "rank": 1, "pid": os.getpid()}))
    os.utime(left, (past, past))
    assert ("powersave_gpu_power_watts", (("gpu", "GPU-old"), ("source", "simulated"))) in samples(scrape(tmp_path))


def test_missing_or_vanished_stats_dir(tmp_path):
    got = samples(scrape(tmp_path / "never"))
    assert got[("vllm_own_requests_total", ())] == 1.0
    assert [dict(k[1]) for k in got if k[0] == "powersave_info"] == [
        {"version": "t", "source": "pending", "clock_backend": "pending", "cuda_perf_boost": "pending"}
    ]


def test_an_unexpected_collector_failure_leaves_vllms_metrics_served(tmp_path, monkeypatch, warnings_seen):
    def boom(d):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(metrics, "load_snapshots", boom)
    got = samples(scrape(tmp_path))
    assert got == {("vllm_own_requests_total", ()): 1.0, ("vllm_own_requests_created", ()): got[("vllm_own_requests_created", ())]}
    assert any("disk on fire" in m for m in warnings_seen)


def test_a_full_snapshot_fills_every_family_of_the_table(tmp_path):
    """Every row of metrics.FAMILIES gets samples from a snapshot that holds every figure (a family
    the collector fills under a wrong name would fail the whole scrape, caught, and export nothing)."""
    full = {
        **GOOD,
        "engine": 0,
        "energy_j": {"prefill": 1.5, "decode": 2.0, "idle": 10.0},
        "window": {"window_s": 60.0, "seconds": 30.0, "energy_j": 12.5, "prefill_tokens": 100, "decode_tokens": 33},
        "steady": {"seconds": 5.0, "energy_j": 4.0, "tokens": {"prefill": 20, "decode": 80}},
        "mem_clock_mhz": 2619,
        "temperature_c": 41.5,
        "clock_event_reasons": 4,
        "target_sm_clock_mhz": 1400,
        "counter_resets": 1,
        "counter_wraps": 2,
        "meter_faults": 3,
        "energy_crosscheck_ratio": 1.01,
        "lm_head_calls": {"1": 10},
        "cuda_perf_boost": "auto",
        "cuda_boost": {"held": True, "switches": 7},
        "closed_loop": {
            "step_time_source": "simulated",
            "probes_total": 5,
            "read_back_mhz": 1200,
            "buckets": {"8": {"state": "hold", "baseline_ms": 12.5}},
        },
        "idle_while_busy_j": 3.25,
        "idle_while_busy_s": 0.5,
        "frontend_busy_s": 4.0,
        "requests_finished": 12,
        "request_energy_j_finished": 8.5,
        "request_energy_j_tail": 0.75,
        "savings": {"clocks": {"state": "on", "basis": "measured"}},
        "decode_pacing": {"tpot_target_ms": 30.0, "held_steps": 4, "held_s": 0.1, "woken_early": 1},
    }
    (tmp_path / "rank0.json").write_text(json.dumps(full))
    exposed = {fam.name for fam in text_string_to_metric_families(scrape(tmp_path)) if fam.samples}
    assert exposed >= {f.name for f in metrics.FAMILIES}
    assert len(metrics.FAMILIES) == len({f.name for f in metrics.FAMILIES})


def test_metrics_export_the_read_back_sm_clock_and_unconfirmed_switches(tmp_path):
    snap = {**GOOD, "closed_loop": {"buckets": {}, "read_back_mhz": 1035, "unconfirmed_switches": 3}}
    (tmp_path / "rank0.json").write_text(json.dumps(snap))
    got = samples(scrape(tmp_path))
    assert got[("powersave_closed_loop_read_back_sm_clock_mhz", (("backend", "simulated"), ("gpu", "GPU-a")))] == 1035.0
    assert got[("powersave_closed_loop_unconfirmed_switches_total", (("gpu", "GPU-a"),))] == 3.0


def test_metrics_export_what_decode_pacing_held(tmp_path):
    pacing = {
        "tpot_target_ms": 30.0,
        "held_steps": 7,
        "held_s": 0.125,
        "woken_early": 2,
        "paused": 1,
        "closed_loop_pauses": 3,
        "pauses_withdrawn": 2,
        "closed_loop_checks": 4,
        "checking": 0,
    }
    snap = {**GOOD, "decode_pacing": pacing}
    (tmp_path / "rank0.json").write_text(json.dumps(snap))
    got = samples(scrape(tmp_path))
    assert got[("powersave_decode_pacing_held_steps_total", (("gpu", "GPU-a"),))] == 7.0
    assert got[("powersave_decode_pacing_held_seconds_total", (("gpu", "GPU-a"),))] == 0.125
    assert got[("powersave_decode_pacing_woken_early_total", (("gpu", "GPU-a"),))] == 2.0
    assert got[("powersave_decode_pacing_paused", (("gpu", "GPU-a"),))] == 1.0
    assert got[("powersave_decode_pacing_closed_loop_pauses_total", (("gpu", "GPU-a"),))] == 3.0
    assert got[("powersave_decode_pacing_pauses_withdrawn_total", (("gpu", "GPU-a"),))] == 2.0
    assert got[("powersave_decode_pacing_closed_loop_checks_total", (("gpu", "GPU-a"),))] == 4.0
    assert got[("powersave_decode_pacing_checking", (("gpu", "GPU-a"),))] == 0.0
    (tmp_path / "rank0.json").write_text(json.dumps({**snap, "decode_pacing": {**pacing, "paused": 0, "checking": 1}}))
    got = samples(scrape(tmp_path))
    assert got[("powersave_decode_pacing_checking", (("gpu", "GPU-a"),))] == 1.0
    assert got[("powersave_decode_pacing_paused", (("gpu", "GPU-a"),))] == 0.0
