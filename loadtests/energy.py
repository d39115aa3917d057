"""Energy sources for the measured window.

Preference order:

1. The server's Prometheus counter ``powersave_gpu_energy_joules_total`` (published by
   the vllm-powersave plugin, labels ``gpu``, ``phase``, ``source``) at ``{base}/metrics``.
2. Local NVML total-energy counters (only meaningful when the server runs on this host).
3. None: energy fields are ``None`` and the report says "no energy source".

(Or Zeus's daemon ``zeusd``, when asked for.) NVML and zeusd are reached only through the
package's device layer (:mod:`vllm_powersave.device`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from vllm_powersave import envs
from vllm_powersave.device import GpuError, NvmlGpu, ZeusdClient, device_count, init_nvml

METRIC = "powersave_gpu_energy_joules"
_SAMPLE_NAMES = {METRIC, METRIC + "_total"}

LabelKey = tuple[tuple[str, str], ...]


def parse_energy_counters(text: str) -> dict[LabelKey, float] | None:
    """Extract ``powersave_gpu_energy_joules_total`` samples (joules) keyed by label set.

    ``prometheus_client`` strips ``_total`` from a counter's family name but not from an
    untyped family's, so both spellings are accepted; ``_created`` samples are skipped.
    Returns ``None`` when the metric is absent or the text does not parse.
    """
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[LabelKey, float] = {}
    try:
        for fam in text_string_to_metric_families(text):
            if fam.name not in _SAMPLE_NAMES:
                continue
            for s in fam.samples:
                if s.name in _SAMPLE_NAMES:
                    found[tuple(sorted(s.labels.items()))] = float(s.value)
    except Exception:  # the parser raises bare ValueError/TypeError variants on bad input
        return None
    return found or None


@dataclass
class EnergyReading:
    """Energy over the measured window. ``energy_j`` is None when no source exists."""

    energy_j: float | None = None
    window_s: float = 0.0
    source: str | None = None  # "measured" | "simulated"
    provider: str | None = None  # "server-metrics" | "nvml"
    by_phase_j: dict[str, float] = field(default_factory=dict)
    by_gpu_j: dict[str, float] = field(default_factory=dict)
    note: str = ""
    counter_resets: int = 0  # series seen going down between two readings (server or driver restart)
    # Front-end starvation over the window (the plugin's powersave_idle_while_busy_* counters):
    # idle GPU energy (J) and time (s) while the server had requests in flight, and that busy time (s).
    idle_while_busy_j: float | None = None
    idle_while_busy_s: float | None = None
    frontend_busy_s: float | None = None
    # The server's counter-vs-power-integral ratio by GPU at the window's end (the plugin's
    # powersave_energy_crosscheck_ratio gauge; docs/metrics.md); None where it publishes none.
    energy_crosscheck_ratio: dict[str, float] | None = None
    # The plugin's powersave_info labels at the window's end (version, source, clock_backend,
    # cuda_perf_boost): what the server ran with, so that ``advise`` knows its perf-boost mode.
    powersave_info: dict[str, str] | None = None
    # How far ``window_s`` may be off the span the counters cover (s): half the span of the first
    # and of the last counter read (a zeusd round trip, or an NVML read aligned on a counter update
    # from the last poll that saw the old value; 0 for server metrics). A stalled client makes it large.
    window_edge_s: float = 0.0


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def diff_counters(before: dict[LabelKey, float], after: dict[LabelKey, float]) -> EnergyReading:
    """Sum counter deltas (J) over label sets, per phase and per GPU, and derive the source label.

    A label set missing before counts from 0 (a series appears on first use); a counter
    that went down was reset, so its post-reset value is the delta (Prometheus semantics).
    ``source`` is "measured" only if every series that advanced says ``measured``;
    a mix, ``simulated``, or a missing label yields "simulated" (never overclaim).
    """
    total = 0.0
    by_phase: dict[str, float] = {}
    by_gpu: dict[str, float] = {}
    sources: set[str] = set()
    all_sources: set[str] = set()
    resets = 0
    for key, v_after in after.items():
        v_before = before.get(key, 0.0)
        resets += v_after < v_before
        delta = v_after - v_before if v_after >= v_before else v_after
        labels = dict(key)
        src = labels.get("source", "")
        all_sources.add(src)
        if delta > 0:
            sources.add(src)
        total += delta
        phase = labels.get("phase", "unknown")
        by_phase[phase] = by_phase.get(phase, 0.0) + delta
        gpu = labels.get("gpu", "all")
        by_gpu[gpu] = by_gpu.get(gpu, 0.0) + delta
    considered = sources or all_sources
    source = "measured" if considered == {"measured"} else "simulated"
    return EnergyReading(
        energy_j=total, source=source, provider="server-metrics", by_phase_j=by_phase, by_gpu_j=by_gpu, counter_resets=resets
    )


class NvmlEnergy:
    """Local GPU energy via NVML's total-energy counter (mJ since driver load), by NVML index."""

    def __init__(self, gpus: list[NvmlGpu], indices: list[int]) -> None:
        self._gpus = gpus
        self._indices = indices

    @classmethod
    def open(cls, gpus: list[int] | None) -> tuple[NvmlEnergy | None, str]:
        """Return ``(reader, "")`` or ``(None, reason)`` when NVML or the counter is unavailable."""
        try:
            nvml = init_nvml()
            count = device_count(nvml)
            indices = list(range(count)) if gpus is None else list(gpus)
            if not indices:
                return None, "no GPUs visible to NVML"
            bad = [i for i in indices if i >= count]
            if bad:
                return None, f"GPU indices {bad} not present (NVML sees {count})"
            reader = cls([NvmlGpu.from_index(i, nvml) for i in indices], indices)
            reader.read_j()  # fails early on GPUs without the energy counter (pre-Volta) and on MIG devices
            return reader, ""
        except GpuError as e:  # any of them means "unavailable"
            return None, f"NVML unavailable: {e}"

    def read_j(self) -> float:
        """Sum of the selected GPUs' energy counters in joules."""
        return sum(g.total_energy_mj() for g in self._gpus) / 1000.0

    def per_gpu_j(self) -> dict[str, float]:
        """Per-GPU counter values in joules, keyed by index."""
        return {str(i): g.total_energy_mj() / 1000.0 for i, g in zip(self._indices, self._gpus)}

    async def aligned_per_gpu_j(self, max_wait_s: float = 0.25, poll_s: float = 0.002) -> tuple[float, float, dict[str, float]]:
        """``(t, span_s, per-GPU joules)`` taken right when the first GPU's counter updates.

        The counter advances in ~100 ms steps, so a window read at arbitrary times is off by up to
        a step at each edge (±2 % on a 5 s window). Starting and ending the window on a counter
        update removes that quantisation; the window then grows by < 100 ms per edge (the energy
        of that time is real and stays in). Falls back to a plain read after ``max_wait_s``.

        The update lies between the last poll that still saw the old value and the end of the read
        of every GPU: ``t`` is that span's midpoint and ``span_s`` its length (s), a few ms unless
        the poller stalled (a loaded host), which then shows in ``span_s`` instead of shifting ``t``.
        (A plain read after ``max_wait_s`` without an update is stamped at its own span.)
        """
        g0 = self._gpus[0]
        before = time.perf_counter()  # the last poll known to precede the update
        first = g0.total_energy_mj()
        deadline = before + max_wait_s
        while True:
            polled = time.perf_counter()
            # Read before testing the deadline: after a stall past it the counter has moved.
            if g0.total_energy_mj() != first:
                break
            before = polled
            if polled >= deadline:
                break
            await asyncio.sleep(poll_s)
        per_gpu = self.per_gpu_j()
        after = time.perf_counter()
        return (before + after) / 2, after - before, per_gpu


async def scrape_metrics(session: aiohttp.ClientSession, base_url: str, timeout_s: float) -> str | None:
    """``GET {base_url}/metrics`` text, or None on any error (metrics are optional)."""
    try:
        async with session.get(base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s), allow_redirects=False) as resp:
            if resp.status != 200:
                return None
            return await resp.text(errors="replace")
    except Exception:  # unreachable/timeout/bad encoding: fall through to the next source
        return None


_KEEP_PREFIXES = (
    "powersave_gpu_energy_joules",
    "powersave_gpu_power_watts",
    "powersave_sm_clock_mhz",
    "powersave_info",
    "vllm:num_requests_running",
    "powersave_idle_while_busy_",
    "powersave_frontend_busy_seconds",
    "powersave_energy_crosscheck_ratio",
)
#: Starvation counters (summed over GPUs) -> Scrape/Sample field.
_STARVATION = {
    "powersave_idle_while_busy_energy_joules_total": "idle_while_busy_j",
    "powersave_idle_while_busy_seconds_total": "idle_while_busy_s",
    "powersave_frontend_busy_seconds_total": "frontend_busy_s",
}


def filter_metrics_text(text: str) -> str:
    """Only the lines of the series the harness reads (vLLM's /metrics is large; parsing it all twice
    a second would cost the client a few ms per scrape)."""
    keep = []
    for line in text.splitlines():
        body = line[7:] if line.startswith(("# HELP ", "# TYPE ")) else line
        if body.startswith(_KEEP_PREFIXES):
            keep.append(line)
    return "\n".join(keep) + "\n"


@dataclass
class Scrape:
    """The series the harness uses from one ``/metrics`` text."""

    counters: dict[LabelKey, float] | None = None  # energy counters (J) by label set; None = absent
    power_w: float | None = None  # sum of powersave_gpu_power_watts over GPUs
    sm_clock_mhz: float | None = None  # mean of powersave_sm_clock_mhz over GPUs
    gauge_source: str | None = None  # "measured" | "simulated" (from the gauges' source label)
    running: float | None = None  # vllm:num_requests_running summed over engines
    plugin: bool = False  # powersave_info present
    info: dict[str, str] | None = None  # powersave_info's labels (several engines: values joined by ",")
    idle_while_busy_j: float | None = None  # summed over GPUs; None = not published
    idle_while_busy_s: float | None = None
    frontend_busy_s: float | None = None
    # The plugin's counter-vs-power-integral check, last completed window, by GPU (None: not published)
    energy_crosscheck_ratio: dict[str, float] | None = None


def join_info(infos: Sequence[dict[str, str] | None]) -> dict[str, str] | None:
    """Several powersave_info label sets (engines, servers) as one: each label's distinct values,
    sorted and joined by "," (``advise`` reads ``cuda_perf_boost: "auto,on"`` as mixed modes)."""
    have = [i for i in infos if i]
    if not have:
        return None
    # A label one engine lacks is unknown for the whole set, not the others' value alone.
    keys = [k for k in dict.fromkeys(k for i in have for k in i) if all(k in i for i in have)]
    return {k: ",".join(sorted({str(i[k]) for i in have})) for k in keys}


def _samples(text: str) -> list[Any]:
    """The samples of a /metrics text. Where the text does not parse as a whole, each line is
    parsed alone and a malformed one is skipped: one bad line (a label the parser rejects) must
    not cost the reading its energy counters."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        return [smp for fam in text_string_to_metric_families(text) for smp in fam.samples]
    except Exception:  # the parser raises bare ValueError/TypeError variants on bad input
        pass
    out = []
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            try:
                out += [smp for fam in text_string_to_metric_families(line + "\n") for smp in fam.samples]
            except Exception:
                continue
    return out


def parse_scrape(text: str) -> Scrape:
    """Parse a (filtered or full) ``/metrics`` text into a :class:`Scrape`; never raises."""
    out = Scrape()
    counters: dict[LabelKey, float] = {}
    power: list[float] = []
    clock: list[float] = []
    sources: set[str] = set()
    running: list[float] = []
    starv: dict[str, float] = {}
    cross: dict[str, float] = {}
    info: list[dict[str, str]] = []
    try:
        for smp in _samples(filter_metrics_text(text)):
            if smp.name in _SAMPLE_NAMES:
                counters[tuple(sorted(smp.labels.items()))] = float(smp.value)
            elif smp.name == "powersave_gpu_power_watts":
                power.append(float(smp.value))
                sources.add(smp.labels.get("source", ""))
            elif smp.name == "powersave_sm_clock_mhz":
                clock.append(float(smp.value))
                sources.add(smp.labels.get("source", ""))
            elif smp.name == "vllm:num_requests_running":
                running.append(float(smp.value))
            elif smp.name == "powersave_info":
                out.plugin = True
                info.append(dict(smp.labels))
            elif smp.name in _STARVATION:
                key = _STARVATION[smp.name]
                starv[key] = starv.get(key, 0.0) + float(smp.value)
            elif smp.name == "powersave_energy_crosscheck_ratio":
                cross[smp.labels.get("gpu", "")] = float(smp.value)
    except Exception:  # the parser raises bare ValueError/TypeError variants on bad input
        return Scrape()
    out.counters = counters or None
    out.power_w = sum(power) if power else None
    out.sm_clock_mhz = sum(clock) / len(clock) if clock else None
    out.gauge_source = ("measured" if sources == {"measured"} else "simulated") if sources else None
    out.running = sum(running) if running else None
    out.energy_crosscheck_ratio = cross or None
    out.info = join_info(info)
    for key, v in starv.items():
        setattr(out, key, v)
    return out


@dataclass
class Sample:
    """One reading of an energy source at ``t`` (``time.perf_counter`` s).

    ``counters`` (server metrics, J by label set) or ``gpu_j`` (NVML, J by GPU index) are cumulative;
    either is None when the read failed. Gauges are None when not published.
    """

    t: float
    counters: dict[LabelKey, float] | None = None
    gpu_j: dict[str, float] | None = None
    power_w: float | None = None
    sm_clock_mhz: float | None = None
    gauge_source: str | None = None
    running: float | None = None
    provider: str | None = None  # of ``gpu_j``: "nvml" (local) or "zeusd" (the daemon's read API)
    idle_while_busy_j: float | None = None  # cumulative starvation counters (server metrics), J / s
    idle_while_busy_s: float | None = None
    frontend_busy_s: float | None = None
    energy_crosscheck_ratio: dict[str, float] | None = None  # server gauge by GPU, when published
    powersave_info: dict[str, str] | None = None  # the plugin's powersave_info labels, when published
    read_s: float = 0.0  # span in which the counters were read (s): zeusd round trip, aligned NVML read; ``t`` is its midpoint


def _nvml_gauges(nvml: NvmlEnergy) -> tuple[float | None, float | None]:
    """Summed power (W, NVML's 1 s average) and mean SM clock (MHz) of the selected GPUs; read-only."""
    try:
        power = sum(g.average_power_w() for g in nvml._gpus)
        clocks = [g.sm_clock_mhz() for g in nvml._gpus]
        return power, sum(clocks) / len(clocks)
    except GpuError:  # older drivers / fakes without these queries: timeline just lacks them
        return None, None


class ZeusdEnergy:
    """GPU energy from Zeus's daemon ``zeusd`` (its ``gpu-read`` API group, no privilege needed).

    ``GET /gpu/get_cumulative_energy?gpu_ids=0,1`` answers ``{"0": {"energy_mj": N}, ...}`` (NVML's
    total-energy counter, mJ) and ``GET /gpu/get_power`` ``{"timestamp_ms": T, "power_mw": {"0": P}}``
    (zeusd 0.4+, ``zeusd/src/routes/gpu.rs`` of ml-energy/zeus). Reached over TCP
    (``http://node:4938``, e.g. a server on another host) or its Unix socket (a path); a JWT from
    ``$ZEUSD_TOKEN`` goes in ``Authorization: Bearer``. GPU indices are zeusd's (NVML order).
    The device layer's :class:`~vllm_powersave.device.ZeusdClient` makes each (blocking) request on a
    worker thread, so the event loop driving the load never waits on the daemon. Only the given
    address is contacted (no proxy from the environment).
    """

    def __init__(self, target: str, gpus: list[int] | None, timeout_s: float, token: str | None) -> None:
        self._client = ZeusdClient(target, token, timeout_s)
        self._gpus = list(gpus) if gpus else None

    async def per_gpu_j(self) -> dict[str, float]:
        """Per-GPU counter values in joules, keyed by zeusd's GPU index. Raises on any failure."""
        mj = await asyncio.to_thread(self._client.total_energy_mj, self._gpus)
        if not mj:
            raise RuntimeError("zeusd /gpu/get_cumulative_energy: no GPU in the reply")
        return {str(k): v / 1000.0 for k, v in mj.items()}

    async def power_w(self) -> float | None:
        """Summed instant power (W) of the selected GPUs, or None."""
        try:
            mw = await asyncio.to_thread(self._client.power_mw, self._gpus)
            return sum(mw.values()) / 1000.0
        except GpuError:  # gauges are optional
            return None

    async def close(self) -> None:
        """Nothing to release: the client keeps no connection between requests."""


def _frontend_fields(sc: Scrape) -> dict:
    """The server's own figures a :class:`Sample` carries from a scrape, whatever the energy
    source: requests running, the starvation counters and the energy cross-check."""
    return dict(
        running=sc.running,
        idle_while_busy_j=sc.idle_while_busy_j,
        idle_while_busy_s=sc.idle_while_busy_s,
        frontend_busy_s=sc.frontend_busy_s,
        energy_crosscheck_ratio=sc.energy_crosscheck_ratio,
        powersave_info=sc.info,
    )


class EnergyMeter:
    """Brackets the measured window: :meth:`start` before load, :meth:`sample` during, :meth:`stop` after.

    Every reading (start, samples, stop) is kept in :attr:`samples`, so the energy of any sub-window
    between two readings can be computed afterwards (steady-state window, timelines).
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        gpus: list[int] | None,
        timeout_s: float = 5.0,
        mode: str = "auto",
        zeusd: str | None = None,
        metrics_interval_s: float = 15.0,
    ):
        self._mode = mode
        self._metrics_interval_s = metrics_interval_s
        self._scraped_t = -math.inf  # when /metrics was last scraped (perf_counter s)
        self._zeusd = ZeusdEnergy(zeusd, gpus, timeout_s, envs.zeusd_token()) if mode == "zeusd" and zeusd else None
        self._zeusd_ok = False
        self._session = session
        self._base_url = base_url
        self._gpus = gpus
        self._timeout_s = timeout_s
        self._before: dict[LabelKey, float] | None = None
        self._nvml: NvmlEnergy | None = None
        self._nvml_before: dict[str, float] | None = None
        self._t0 = 0.0
        self._note = ""
        self.samples: list[Sample] = []

    @property
    def note(self) -> str:
        """Why there is no energy source (empty when there is one)."""
        return self._note

    @property
    def provider(self) -> str | None:
        """``server-metrics``, ``nvml`` or None (no energy source)."""
        if self._before is not None:
            return "server-metrics"
        if self._zeusd_ok:
            return "zeusd"
        return "nvml" if self._nvml is not None and self._nvml_before is not None else None

    async def _scrape(self) -> tuple[float, Scrape | None]:
        text = await scrape_metrics(self._session, self._base_url, self._timeout_s)
        self._scraped_t = time.perf_counter()
        return self._scraped_t, (parse_scrape(text) if text is not None else None)

    def _scrape_due(self) -> bool:
        """Whether a periodic ``/metrics`` scrape is due (``metrics_interval_s``; 0: edges only)."""
        return self._metrics_interval_s > 0 and time.perf_counter() - self._scraped_t >= self._metrics_interval_s

    async def _with_frontend(self, sample: Sample, sc: Scrape | None = None, scrape: bool = True) -> Sample:
        """``sample`` (a local NVML or zeusd reading) with the server's front-end figures from
        ``/metrics`` (the starvation counters where the plugin publishes them): scraped now unless
        ``sc`` is given or ``scrape`` is False, so that both arms of a comparison load the server alike."""
        if sc is None and scrape and self._base_url:
            _, sc = await self._scrape()
        return sample if sc is None else replace(sample, **_frontend_fields(sc))

    @staticmethod
    def _from_scrape(t: float, sc: Scrape | None) -> Sample:
        if sc is None:
            return Sample(t=t)
        return Sample(
            t=t,
            counters=sc.counters or ({} if sc.plugin else None),
            power_w=sc.power_w,
            sm_clock_mhz=sc.sm_clock_mhz,
            gauge_source=sc.gauge_source,
            **_frontend_fields(sc),
        )

    async def start(self) -> None:
        """Take the "before" reading, choosing the first available source."""
        self._t0 = time.perf_counter()
        if self._mode == "none":
            self._note = "no energy source (disabled by energy='none')"
            return
        if self._mode == "zeusd":
            if self._zeusd is None:
                self._note = "no energy source (energy='zeusd' needs the daemon's address: zeusd=URL or socket path)"
                return
            try:
                first = await self._zeusd_sample()
            except Exception as e:  # unreachable, refused, wrong API group: say which, never crash
                await self._zeusd.close()
                self._note = f"no energy source (zeusd: {_one_line(e)})"
                return
            self._t0 = first.t
            self._zeusd_ok = True
            self.samples.append(await self._with_frontend(first))
            return
        reason = "not tried"
        sc = None
        if self._mode in ("auto", "server"):
            self._t0, sc = await self._scrape()
            counters = sc.counters if sc is not None else None
            if counters is None and sc is not None and sc.plugin:
                counters = {}  # plugin active, no step booked yet: every counter is still 0
            if counters is not None:
                self._before = counters
                self.samples.append(self._from_scrape(self._t0, sc))
                return
            if self._mode == "server":
                self._note = f"no energy source (server has no {METRIC}_total)"
                return
        self._nvml, reason = NvmlEnergy.open(self._gpus)
        if self._nvml is not None:
            if sc is None:  # the same edge scrape as a server whose counters are the source
                _, sc = await self._scrape()
            self._t0, span, self._nvml_before = await self._nvml.aligned_per_gpu_j()
            power, clock = _nvml_gauges(self._nvml)
            first = Sample(
                t=self._t0,
                read_s=span,
                gpu_j=dict(self._nvml_before),
                power_w=power,
                sm_clock_mhz=clock,
                gauge_source="measured" if power is not None else None,
                provider="nvml",
            )
            self.samples.append(await self._with_frontend(first, sc, scrape=False))
        elif self._mode == "nvml":
            self._note = f"no energy source ({reason})"
        else:
            self._note = f"no energy source (server has no {METRIC}_total; {reason})"

    async def sample(self) -> None:
        """One periodic reading (a plain scrape or NVML read, not aligned); no-op without a source."""
        due = self._scrape_due()
        if self._zeusd_ok:
            try:
                self.samples.append(await self._with_frontend(await self._zeusd_sample(), scrape=due))
            except Exception:  # a failed read leaves a gap; the window edges still come from start/stop
                t, power = time.perf_counter(), await self._zeusd.power_w()
                self.samples.append(Sample(t=t, power_w=power, provider="zeusd", gauge_source="measured" if power is not None else None))
        elif self._before is not None:
            if due:  # the server's counters are the source: they come at the scrape period
                t, sc = await self._scrape()
                self.samples.append(self._from_scrape(t, sc))
        elif self._nvml is not None and self._nvml_before is not None:
            try:
                gpu_j = self._nvml.per_gpu_j()
            except Exception:  # a failed read leaves a gap; the window edges still come from start/stop
                gpu_j = None
            power, clock = _nvml_gauges(self._nvml)
            reading = Sample(
                t=time.perf_counter(),
                gpu_j=gpu_j,
                power_w=power,
                sm_clock_mhz=clock,
                gauge_source="measured" if power is not None else None,
                provider="nvml",
            )
            self.samples.append(await self._with_frontend(reading, scrape=due))

    async def _zeusd_sample(self) -> Sample:
        """One zeusd reading: energy counters (raises when they cannot be read) and power (optional)."""
        assert self._zeusd is not None
        # The daemon reads the counter somewhere inside the round trip; its midpoint is the best
        # stamp, and the round trip bounds the error (a loaded client can stall the reply by ~1 s).
        sent = time.perf_counter()
        gpu_j = await self._zeusd.per_gpu_j()
        got = time.perf_counter()
        power = await self._zeusd.power_w()
        return Sample(
            t=(sent + got) / 2,
            read_s=got - sent,
            gpu_j=gpu_j,
            power_w=power,
            provider="zeusd",
            gauge_source="measured" if power is not None else None,
        )

    def _window_reading(self, t1: float, note: str = "") -> EnergyReading:
        """The window's energy over every reading so far, the last taken at ``t1`` (s)."""
        r = energy_over(self.samples)
        assert r is not None  # the first and the last reading both have counters
        r.window_s = t1 - self._t0
        r.note = "; ".join(x for x in (note, r.note) if x)
        starvation_over(self.samples, r)
        return r

    async def stop(self) -> EnergyReading:
        """Take the "after" reading and return the window's energy (J) and duration (s)."""
        if self._zeusd_ok:
            assert self._zeusd is not None
            try:
                last = await self._zeusd_sample()
            except Exception as e:
                return EnergyReading(
                    window_s=time.perf_counter() - self._t0, note=f"no energy source (final zeusd read failed: {_one_line(e)})"
                )
            finally:
                await self._zeusd.close()
            self.samples.append(await self._with_frontend(last))
            return self._window_reading(last.t, "zeusd gpu-read counters (the GPUs of the daemon's host)")
        if self._before is not None:
            t1, sc = await self._scrape()
            window = t1 - self._t0
            self.samples.append(self._from_scrape(t1, sc))
            after = self.samples[-1].counters
            if after is None:
                return EnergyReading(window_s=window, note="no energy source (final /metrics scrape failed)")
            return self._window_reading(t1)
        if self._nvml is not None and self._nvml_before is not None:
            try:
                t1, span, after_gpu = await self._nvml.aligned_per_gpu_j()
            except Exception as e:  # driver hiccup: report no energy instead of crashing the run
                return EnergyReading(window_s=time.perf_counter() - self._t0, note=f"no energy source (NVML read failed: {e})")
            power, clock = _nvml_gauges(self._nvml)
            last = Sample(
                t=t1,
                read_s=span,
                gpu_j=dict(after_gpu),
                power_w=power,
                sm_clock_mhz=clock,
                gauge_source="measured" if power is not None else None,
                provider="nvml",
            )
            self.samples.append(await self._with_frontend(last))
            return self._window_reading(t1, "local NVML counters (server assumed to run on this host)")
        return EnergyReading(window_s=time.perf_counter() - self._t0, note=self._note or "no energy source")


def starvation_over(samples: list[Sample], r: EnergyReading) -> None:
    """Fill ``r``'s idle-while-busy figures from the first to the last reading that has them
    (the series appear once the server's API process has written its busy file)."""
    ratios = [s.energy_crosscheck_ratio for s in samples if s.energy_crosscheck_ratio]
    r.energy_crosscheck_ratio = dict(ratios[-1]) if ratios else None  # a gauge: its last value
    infos = [s.powersave_info for s in samples if s.powersave_info]
    r.powersave_info = dict(infos[-1]) if infos else None
    have = [s for s in samples if s.idle_while_busy_j is not None]
    if have and samples[0].counters is not None and samples[0].idle_while_busy_j is None:
        # The server's metrics were read at the start but had no starvation series yet: the
        # worker publishes them once it has read an API server's busy file, and until then it
        # books nothing as idle-while-busy, so the counters stood at 0 (a saturation window that
        # opens on a fresh server otherwise read n/a beside runs that read 0).
        have.insert(0, Sample(t=samples[0].t, idle_while_busy_j=0.0, idle_while_busy_s=0.0, frontend_busy_s=0.0))
    if len(have) < 2:
        return
    a, b = have[0], have[-1]
    r.idle_while_busy_j = max(0.0, b.idle_while_busy_j - a.idle_while_busy_j)  # type: ignore[operator]
    r.idle_while_busy_s = max(0.0, (b.idle_while_busy_s or 0.0) - (a.idle_while_busy_s or 0.0))
    r.frontend_busy_s = max(0.0, (b.frontend_busy_s or 0.0) - (a.frontend_busy_s or 0.0))


def energy_between(a: Sample, b: Sample) -> EnergyReading | None:
    """Energy (J) between two readings of one meter, or None if either read failed."""
    if a.counters is not None and b.counters is not None:
        r = diff_counters(a.counters, b.counters)
        r.window_s = b.t - a.t
        return r
    if a.gpu_j is not None and b.gpu_j is not None:
        # NVML's counter restarts only with the driver; a lower value is then the energy since.
        by_gpu = {k: (v - a.gpu_j.get(k, 0.0)) if v >= a.gpu_j.get(k, 0.0) else v for k, v in b.gpu_j.items()}
        return EnergyReading(
            energy_j=sum(by_gpu.values()),
            window_s=b.t - a.t,
            source="measured",
            provider=b.provider or "nvml",
            by_gpu_j=by_gpu,
            counter_resets=sum(v < a.gpu_j.get(k, 0.0) for k, v in b.gpu_j.items()),
        )
    return None


def energy_over(samples: list[Sample]) -> EnergyReading | None:
    """Energy (J) from the first to the last readable reading of one meter, summed over consecutive
    readings (Prometheus ``increase()``): a counter reset between two readings loses only the
    energy of that interval before the reset, and is counted in ``counter_resets`` and the note.
    Failed reads are skipped. None with fewer than two readable readings."""
    ok = [x for x in samples if x.counters is not None or x.gpu_j is not None]
    parts = [r for r in (energy_between(a, b) for a, b in zip(ok, ok[1:])) if r is not None]
    if not parts:
        return None
    by_phase: dict[str, float] = {}
    by_gpu: dict[str, float] = {}
    for r in parts:
        for k, v in r.by_phase_j.items():
            by_phase[k] = by_phase.get(k, 0.0) + v
        for k, v in r.by_gpu_j.items():
            by_gpu[k] = by_gpu.get(k, 0.0) + v
    resets = sum(r.counter_resets for r in parts)
    # A part that moved no counter says nothing about the source; the advancing ones decide.
    moved = {r.source for r in parts if r.energy_j}
    source = "measured" if (moved or {r.source for r in parts}) == {"measured"} else "simulated"
    note = (
        (
            f"{resets} counter reset(s) during the window (server or driver restart): the energy between the last "
            "reading before a reset and the reset is missing (sample more often to narrow it)"
        )
        if resets
        else ""
    )
    return EnergyReading(
        energy_j=sum(r.energy_j or 0.0 for r in parts),
        window_s=ok[-1].t - ok[0].t,
        window_edge_s=(ok[0].read_s + ok[-1].read_s) / 2,
        source=source,
        provider=parts[0].provider,
        by_phase_j=by_phase,
        by_gpu_j=by_gpu,
        note=note,
        counter_resets=resets,
    )
