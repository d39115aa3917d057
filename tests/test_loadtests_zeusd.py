"""``loadtests --energy zeusd``: GPU energy from Zeus's daemon (gpu-read API), over TCP and its Unix socket."""

from __future__ import annotations

import time

import pytest
from fakes import FakeNvml, FakeZeusd

from loadtests import BenchConfig, ConfigError, run


class _SteadyGpu(FakeNvml):
    """A GPU drawing a constant ``watts``: its energy counter (mJ) grows with wall time."""

    def __init__(self, watts: float, stall_first_s: float = 0.0) -> None:
        super().__init__(energy_mj=5_000_000)
        self.stall_first_s = stall_first_s  # the first reply leaves this long after the read
        self.watts, self.t0 = watts, time.perf_counter()  # the harness's clock
        self.power_mw = int(watts * 1000)

        self.served: list[int] = []  # every counter value the daemon answered with, in order
        self.read_at: list[float] = []  # and when it read each one (perf_counter s)

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        self.read_at.append(time.perf_counter())
        self.served.append(int(5_000_000 + self.watts * 1000 * (self.read_at[-1] - self.t0)))
        if len(self.served) == 1:
            time.sleep(self.stall_first_s)
        return self.served[-1]


@pytest.mark.parametrize("transport,stall_s", [("tcp", 0.0), ("unix", 0.0), ("tcp", 0.4)])
def test_energy_from_zeusd_over_tcp_and_unix_socket(server_factory, tmp_path, transport, stall_s) -> None:
    srv = server_factory(first_delay=0.01, itl_delay=0.01)
    gpus = [_SteadyGpu(200.0, stall_s), _SteadyGpu(100.0), _SteadyGpu(999.0)]
    with FakeZeusd(None if transport == "tcp" else tmp_path / "zeusd.sock", gpus=gpus) as z:
        target = z.url if transport == "tcp" else z.socket_path
        # A 2 s window: the client's timestamps trail the daemon's reads by a round trip each, which
        # must stay small against the window on a loaded CI machine.
        res = run(
            BenchConfig(
                base_url=srv.url,
                num_prompts=100000,
                max_concurrency=4,
                output_len=8,
                input_len=3,
                duration_s=2.0,
                energy="zeusd",
                zeusd=target,
                gpus=[0, 1],
                sample_interval_s=0.05,
            )
        )
    assert res["energy_source"] == "measured" and res["energy_provider"] == "zeusd"
    # Exactly the daemon's counters of GPUs 0 and 1 from the first read to the last; GPU 2 never read.
    assert res["gpu_energy_j"] == pytest.approx(sum((g.served[-1] - g.served[0]) / 1000 for g in gpus[:2]), abs=1e-6)
    assert gpus[2].served == []
    # 300 W together over the harness's own window, to within the window's stated edge error (the
    # reads' round trips, which a stalled CI machine can stretch to ~1 s).
    edge = res["energy_window_edge_s"]
    assert stall_s / 2 <= edge < res["energy_window_s"]
    span = gpus[0].read_at[-1] - gpus[0].read_at[0]
    assert abs(res["energy_window_s"] - span) <= edge + 1e-3  # the window's edges sit on the reads
    assert res["gpu_avg_power_w"] == pytest.approx(300.0, rel=0.01 + edge / res["energy_window_s"])
    reads = [r for r in z.requests if r[1] == "/gpu/get_cumulative_energy"]
    assert len(reads) >= 3 and all(r[2] == {"gpu_ids": "0,1"} for r in reads)  # start, samples, stop
    assert not [r for r in z.requests if r[0] != "GET"]  # read-only: nothing is ever posted
    tl = res["timeline"]["series"][0]
    assert tl["name"] == "zeusd" and tl["power_w"][0] == pytest.approx(300.0)


def test_token_is_sent_and_refusals_are_one_line_notes(server_factory, tmp_path, monkeypatch) -> None:
    srv = server_factory(first_delay=0.0, itl_delay=0.0)
    cfg = dict(base_url=srv.url, num_prompts=4, output_len=2, input_len=2, energy="zeusd", gpus=[0])
    with FakeZeusd(None, gpus=[_SteadyGpu(150.0)], token="sekret") as z:
        monkeypatch.delenv("ZEUSD_TOKEN", raising=False)
        res = run(BenchConfig(**cfg, zeusd=z.url))
        assert res["gpu_energy_j"] is None and res["completed"] == 4  # the load test itself goes on
        assert "zeusd" in res["energy_note"] and "HTTP 401 (token missing)" in res["energy_note"]
        monkeypatch.setenv("ZEUSD_TOKEN", "sekret")
        res = run(BenchConfig(**cfg, zeusd=z.url))
        assert res["gpu_energy_j"] > 0 and z.requests[-1][3] == "Bearer sekret"
    with FakeZeusd(None, gpus=[_SteadyGpu(150.0)], read_enabled=False) as z:
        res = run(BenchConfig(**cfg, zeusd=z.url))
        assert res["gpu_energy_j"] is None and "gpu-read API group not enabled" in res["energy_note"]
    res = run(BenchConfig(**cfg, zeusd=str(tmp_path / "no-such.sock")))  # no daemon there
    assert res["gpu_energy_j"] is None and res["energy_note"].startswith("no energy source (zeusd:")
    assert "\n" not in res["energy_note"]


def test_zeusd_address_and_source_go_together() -> None:
    with pytest.raises(ConfigError, match="energy 'zeusd' needs the daemon's address"):
        BenchConfig(base_url="http://127.0.0.1:1", energy="zeusd")
    with pytest.raises(ConfigError, match="zeusd = 'http://x:4938'"):
        BenchConfig(base_url="http://127.0.0.1:1", energy="nvml", zeusd="http://x:4938")
