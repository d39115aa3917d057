"""Both arms of a comparison see the same client: the harness scrapes a server's ``/metrics`` at
the window's edges and then at an operator's period (15 s), whatever the energy source, instead of
every energy sample from the server it is measuring (docs/results/h200-under-load.md)."""

import itertools
import time

import pytest

from loadtests import BenchConfig, run
from loadtests import energy as energy_mod
from loadtests.fake_server import STARVED_J


class _CounterNvml:
    """A local NVML reader whose counter grows 100 J per second of wall time, read-only."""

    reads = itertools.count()

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def per_gpu_j(self) -> dict[str, float]:
        next(self.reads)
        return {"0": 100.0 * (time.perf_counter() - self.t0)}

    def read_j(self) -> float:
        return self.per_gpu_j()["0"]

    async def aligned_per_gpu_j(self, max_wait_s: float = 0.25, poll_s: float = 0.002):
        t = time.perf_counter()
        return t, 0.0, self.per_gpu_j()


@pytest.fixture
def nvml(monkeypatch):
    monkeypatch.setattr(energy_mod.NvmlEnergy, "open", classmethod(lambda cls, gpus: (_CounterNvml(), "")))
    monkeypatch.setattr(energy_mod, "_nvml_gauges", lambda reader: (None, None))


def _cfg(url: str, **kw) -> BenchConfig:
    base = dict(base_url=url, num_prompts=24, max_concurrency=4, output_len=16, input_len=3, sample_interval_s=0.02, num_warmups=0)
    return BenchConfig(**(base | kw))


@pytest.mark.parametrize("powersave", [True, False])
def test_a_server_with_or_without_the_plugin_is_scraped_only_at_the_edges(server_factory, nvml, powersave):
    srv = server_factory(first_delay=0.01, itl_delay=0.01, powersave=powersave)
    res = run(_cfg(srv.url, energy="nvml"))
    assert res["completed"] == 24 and res["gpu_energy_j"] > 0 and res["energy_provider"] == "nvml"
    assert res["duration"] > 10 * 0.02  # many energy samples were due in the run ...
    assert srv.metrics_scrapes == 2  # ... and the server under test saw two scrapes, edges only


def test_the_plugins_counters_as_the_source_are_scraped_at_the_metrics_period_not_the_sample_period(server_factory):
    srv = server_factory(first_delay=0.01, itl_delay=0.01)
    res = run(_cfg(srv.url, energy="server", metrics_interval_s=15.0))
    assert res["energy_provider"] == "server-metrics" and res["gpu_energy_j"] > 0
    assert srv.metrics_scrapes == 2
    fast = server_factory(first_delay=0.01, itl_delay=0.01)
    run(_cfg(fast.url, energy="server", metrics_interval_s=0.02))
    assert fast.metrics_scrapes > 4  # asked for: scrapes at the given period


def test_local_nvml_energy_still_carries_the_servers_starvation_from_the_edge_scrapes(server_factory, nvml):
    srv = server_factory(first_delay=0.01, itl_delay=0.01)
    res = run(_cfg(srv.url, energy="nvml"))
    assert res["energy_provider"] == "nvml"
    assert res["gpu_idle_while_busy_energy_j"] == pytest.approx(24 * STARVED_J)


def test_a_stock_server_has_no_starvation_figure_rather_than_zero(server_factory, nvml):
    srv = server_factory(first_delay=0.01, itl_delay=0.01, powersave=False)
    res = run(_cfg(srv.url, energy="nvml"))
    assert res.get("gpu_idle_while_busy_energy_j") is None


def test_metrics_interval_must_not_be_negative():
    from loadtests import ConfigError

    with pytest.raises(ConfigError, match="metrics_interval_s"):
        BenchConfig(base_url="http://127.0.0.1:1", metrics_interval_s=-1)


@pytest.mark.parametrize("source", ["nvml", "server"])
def test_the_servers_energy_crosscheck_reaches_the_result(server_factory, nvml, source):
    srv = server_factory(first_delay=0.01, itl_delay=0.01)
    srv.crosscheck_ratio = 1.02
    res = run(_cfg(srv.url, energy=source))
    assert res["energy_crosscheck_ratio"] == {"0": 1.02}


def test_a_server_without_the_crosscheck_gauge_has_none(server_factory, nvml):
    srv = server_factory(first_delay=0.01, itl_delay=0.01, powersave=False)
    assert run(_cfg(srv.url, energy="nvml"))["energy_crosscheck_ratio"] is None


@pytest.mark.parametrize("source", ["nvml", "server"])
def test_the_servers_perf_boost_mode_reaches_the_result_and_advise_reads_it(server_factory, nvml, source, tmp_path, capsys):
    import json

    from vllm_powersave.cli import main

    srv = server_factory(first_delay=0.01, itl_delay=0.01)
    srv.info = {"version": "0.1.0", "source": "measured", "clock_backend": "dry-run", "cuda_perf_boost": "auto"}
    res = run(_cfg(srv.url, energy=source))
    assert res["powersave_info"] == srv.info
    (p := tmp_path / "r.json").write_text(json.dumps(res))
    assert main(["advise", "--result", str(p), "--json"]) == 0
    recs = json.loads(capsys.readouterr().out)["recommendations"]
    assert not [r for r in recs if "perf-boost mode unknown" in r["measurement"]]  # the mode is known now
    assert "perf_boost" not in [r["key"] for r in recs]  # a run on auto is never told to set auto


def test_a_server_without_the_plugins_labels_has_no_info(server_factory, nvml):
    srv = server_factory(first_delay=0.01, itl_delay=0.01, powersave=False)
    assert run(_cfg(srv.url, energy="nvml"))["powersave_info"] is None


def test_several_engines_labels_join_into_one_mode_list():
    from loadtests.energy import join_info, parse_scrape

    text = 'powersave_info{cuda_perf_boost="on",source="measured"} 1.0\npowersave_info{cuda_perf_boost="auto",source="measured"} 1.0\n'
    assert parse_scrape(text).info == {"cuda_perf_boost": "auto,on", "source": "measured"}
    assert join_info([None, {"cuda_perf_boost": "auto"}]) == {"cuda_perf_boost": "auto"} and join_info([None]) is None


def test_an_engine_without_the_mode_label_makes_the_mode_unknown():
    from loadtests.energy import parse_scrape

    text = 'powersave_info{cuda_perf_boost="on",source="measured"} 1.0\npowersave_info{source="measured"} 1.0\n'
    assert parse_scrape(text).info == {"source": "measured"}


def test_one_malformed_info_line_costs_that_line_not_the_energy_counters():
    from loadtests.energy import parse_scrape

    good = 'powersave_gpu_energy_joules_total{gpu="0",phase="decode",source="measured"} 12.5\n'
    bad = 'powersave_info{cuda_perf_boost="on",cuda_perf_boost="auto"} 1.0\n'  # a duplicate label
    sc = parse_scrape(good + bad)
    assert sc.counters == {(("gpu", "0"), ("phase", "decode"), ("source", "measured")): 12.5} and sc.info is None
    assert parse_scrape("not metrics at all {{{\n").counters is None  # still never raises
