"""Another process on the GPU, seen in NVML's process list (docs/closed-loop.md, "Another
process on the GPU"): the closed loop takes the step-time shifts it brings as that process's
doing, holds its clock, and keeps those steps out of its tests; where the count is unknown it
runs as without the signal. The GPU side here is simulated; NVML is a fake."""

import logging
from types import SimpleNamespace

from fakes import FakeNvml, NVMLError
from test_closed_loop_gpu_changes import SharedGpu
from test_closed_loop_tracking import _loop_settings

from vllm_powersave.clocks.closed_loop import DecodeClockTuner
from vllm_powersave.device import NvmlGpu
from vllm_powersave.runtime.publisher import TenantWatch, tenant_watch
from vllm_powersave.sim.gpu import H200

#: What a test feeds the tuner as the count of other processes: the tenant's presence, or None.
SEEN, UNKNOWN = "seen", "unknown"


class VisibleTenantGpu(SharedGpu):
    """:class:`SharedGpu` whose other job is in the process list while it runs (``SEEN``: the
    count fed at each step's end), or never known (``UNKNOWN``: ``None`` fed), or not fed."""

    def __init__(self, tuner, feed=SEEN, **kw):
        super().__init__(tuner, **kw)
        self.feed = feed

    def run(self, steps, batch=64):
        for _ in range(steps):
            super().run(1, batch)
            if self.feed == SEEN:
                self.tuner.observe_gpu_tenants(self.t, int(self.gpu_factor() != 1.0))
            elif self.feed == UNKNOWN:
                self.tuner.observe_gpu_tenants(self.t, None)
        return self


def _events(tuner, since):
    return [r.event for r in list(tuner.records)[since:]]


def test_a_tenant_in_the_process_list_brings_no_backoff_probe_or_reference_window():
    # Held clock, alone; then another job slows every clock 30 % for 5 s and leaves. Seen in the
    # process list, its shifts are its own: nothing is tested, the held clock stays (one supported
    # clock up while it is there), and after it leaves the clock is held as before.
    for seed in (0, 1, 2):
        tuner = DecodeClockTuner(_loop_settings(), H200.sm_clocks_mhz)
        d = VisibleTenantGpu(tuner, noise=0.01, seed=seed, busy_s=0.0).run(6000)
        while tuner.snapshot()["buckets"][64]["state"] != "hold" or d.clock is None:
            d.run(1)
        held, n0 = d.clock, len(tuner.records)
        d.period_s, d.busy_s = 1e9, 1e9  # the other job comes
        d.run(400)
        during = d.clock
        d.busy_s = 0.0  # and leaves
        d.run(600)
        events = _events(tuner, n0)
        # (A scheduled retry below the held clock may run: it is on a timer, not the tenant's doing.)
        assert not {"violation", "backoff", "rebaseline"} & set(events), (seed, events)
        assert during == min(c for c in H200.sm_clocks_mhz if c > held), (seed, held, during)
        assert d.clock == held, seed
        assert tuner.snapshot()["tenant_steps_total"] >= 400


def test_without_the_count_a_tenant_still_brings_a_reference_window():
    # The same arrival and departure, the count never fed: the held steps faster than the fit
    # re-measure the default clock (the rule the signal replaces).
    tuner = DecodeClockTuner(_loop_settings(), H200.sm_clocks_mhz)
    d = VisibleTenantGpu(tuner, feed=None, noise=0.01, seed=1, busy_s=0.0).run(6000)
    while tuner.snapshot()["buckets"][64]["state"] != "hold" or d.clock is None:
        d.run(1)
    n0 = len(tuner.records)
    d.period_s, d.busy_s = 1e9, 1e9
    d.run(400)
    d.busy_s = 0.0
    d.run(600)
    assert {"violation", "rebaseline"} & set(_events(tuner, n0))


def test_an_unknown_tenant_count_keeps_the_loop_as_without_the_signal():
    # None (no NVML, a driver without the call) decides nothing: every decision and clock is the
    # one of a tuner never fed the count, under the same cycling co-tenant.
    runs = []
    for feed in (UNKNOWN, None):
        tuner = DecodeClockTuner(_loop_settings(), H200.sm_clocks_mhz)
        d = VisibleTenantGpu(tuner, feed=feed, noise=0.01, seed=3).run(20_000)
        runs.append(([(r.t_s, r.event, r.sm_clock_mhz) for r in tuner.records], d.log))
    assert runs[0] == runs[1]


def test_a_cycling_visible_tenant_keeps_the_budget_at_fewer_default_clock_steps():
    # 30 % slower 5 s of every 20 s, seen: the budget holds, and the bucket runs the default clock
    # far less often than with the count unknown (reference windows per arrival and departure).
    share = {}
    for feed in (SEEN, UNKNOWN):
        tuner = DecodeClockTuner(_loop_settings(), H200.sm_clocks_mhz)
        d = VisibleTenantGpu(tuner, feed=feed, noise=0.01, seed=0).run(30_000)
        later = d.log[5000:]
        share[feed] = sum(1 for _, c in later if c is None) / len(later)
        assert sum(s <= 0.01 for s, _ in d.log) / len(d.log) >= 0.995, feed
    assert share[SEEN] < share[UNKNOWN] / 2, share


class _Procs(FakeNvml):
    """A fake NVML whose process list is ``pids``, or raises ``error``, or is missing."""

    def __init__(self, pids=(), error=None, missing=False):
        super().__init__()
        self.pids, self.error = pids, error
        if not missing:
            self.nvmlDeviceGetComputeRunningProcesses = self._procs

    def _procs(self, handle):
        if self.error is not None:
            raise self.error
        return [SimpleNamespace(pid=p, usedGpuMemory=0) for p in self.pids]


def test_other_compute_processes_counts_pids_not_ours():
    gpu = NvmlGpu(_Procs(pids=(100, 101, 200)), 0, "GPU-aaaa-0000")
    assert gpu.other_compute_processes(frozenset({100, 1})) == 2
    assert NvmlGpu(_Procs(pids=(100,)), 0).other_compute_processes(frozenset({100})) == 0


def test_other_compute_processes_maps_nvml_errors_to_none(caplog):
    # An NVML error, a binding or driver without the call, or a list without our own process
    # (a PID namespace: host pids) leave the count unknown, logged once at debug, never raised.
    own = frozenset({100})
    gpu = NvmlGpu(_Procs(error=NVMLError(3)), 0, "GPU-aaaa-0000")
    with caplog.at_level(logging.DEBUG, logger="vllm.powersave.device"):
        assert gpu.other_compute_processes(own) is None
        assert gpu.other_compute_processes(own) is None
    assert sum("process list unavailable" in r.getMessage() for r in caplog.records) == 1
    assert NvmlGpu(_Procs(missing=True), 0).other_compute_processes(own) is None
    assert NvmlGpu(_Procs(pids=(5, 6)), 0).other_compute_processes(own) is None


def test_the_tenant_watch_reads_at_most_every_half_second_and_maps_faults_to_unknown():
    reads = []

    def read():
        reads.append(1)
        if len(reads) == 3:
            raise RuntimeError("boom")
        return 1

    w = TenantWatch(read)
    got = [w.poll(t) for t in (0.0, 0.1, 0.49, 0.5, 0.9, 1.0)]
    assert [None if g is None else g.others for g in got] == [1, None, None, 1, None, None]
    assert got[5] is not None and got[5].others is None and len(reads) == 3


def test_the_perf_boost_helpers_own_context_is_no_tenant():
    """cuda_perf_boost "auto" holds a side CUDA context in a helper process while the engine is
    busy: NVML lists it on this GPU, and counted as another job it would stop the loop's
    measurements under load. The watch leaves out the helper's current PID (it restarts)."""
    holder = SimpleNamespace(pid=300)
    boost = SimpleNamespace(holder=holder)
    gpu = NvmlGpu(_Procs(pids=(100, 300)), 0, "GPU-aaaa-0000")
    watch = tenant_watch(gpu, own_pids=frozenset({100}), boost=boost)
    assert watch.poll(0.0).others == 0
    holder.pid = 301  # a restarted helper; the old PID is a stranger's now
    gpu.nvml.pids = (100, 300, 301)
    assert watch.poll(1.0).others == 1
    assert tenant_watch(gpu, own_pids=frozenset({100})).poll(0.0).others == 2
