"""cuda_perf_boost "auto" under faults: the real helper against a fake CUDA driver (a tiny C
library standing in for libcuda.so.1, built here; no GPU is touched), helpers that die, hang or
talk nonsense, a parent killed with SIGKILL, close() during a hold, thousands of busy/idle flips,
bad ``boost_release_after_s`` values."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from vllm_powersave.clocks.boost import BoostController, BoostHolder, BoostUnavailable

FAKE_LIBCUDA = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
static int act(const char *name) {
    const char *log = getenv("FAKE_CUDA_LOG");
    if (log) { FILE *f = fopen(log, "a"); if (f) { fprintf(f, "%d %s\n", (int)getpid(), name); fclose(f); } }
    const char *hang = getenv("FAKE_CUDA_HANG_ON");
    if (hang && strcmp(hang, name) == 0) for (;;) pause();
    const char *fail = getenv("FAKE_CUDA_FAIL_ON");
    if (fail && strcmp(fail, name) == 0) return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
    return 0;
}
int cuInit(unsigned flags) { return act("cuInit"); }
int cuDeviceGet(int *dev, int ordinal) { *dev = ordinal; return act("cuDeviceGet"); }
int cuDevicePrimaryCtxRetain(void **ctx, int dev) { *ctx = (void *)0x1; return act("cuDevicePrimaryCtxRetain"); }
int cuCtxSetCurrent(void *ctx) { return act("cuCtxSetCurrent"); }
int cuMemAlloc_v2(unsigned long long *p, size_t n) { *p = 0x1000; return act("cuMemAlloc_v2"); }
int cuMemsetD8_v2(unsigned long long p, unsigned char v, size_t n) { return act("cuMemsetD8_v2"); }
int cuCtxSynchronize(void) { return act("cuCtxSynchronize"); }
int cuMemFree_v2(unsigned long long p) { return act("cuMemFree_v2"); }
int cuDevicePrimaryCtxRelease_v2(int dev) { return act("cuDevicePrimaryCtxRelease_v2"); }
"""


@pytest.fixture(scope="module")
def fake_cuda_dir(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the fake CUDA driver")
    d = tmp_path_factory.mktemp("fakecuda")
    (d / "fake.c").write_text(FAKE_LIBCUDA)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / "libcuda.so.1"), str(d / "fake.c")], check=True)
    return d


@pytest.fixture
def fake_cuda(fake_cuda_dir, tmp_path, monkeypatch):
    """The helper (started with this process's environment) loads the fake driver; returns the call log."""
    monkeypatch.setenv("LD_LIBRARY_PATH", str(fake_cuda_dir))
    log = tmp_path / "cuda.log"
    monkeypatch.setenv("FAKE_CUDA_LOG", str(log))
    monkeypatch.delenv("FAKE_CUDA_HANG_ON", raising=False)
    monkeypatch.delenv("FAKE_CUDA_FAIL_ON", raising=False)
    return log


def _calls(log: Path) -> list[str]:
    return [line.split()[1] for line in log.read_text().splitlines()] if log.exists() else []


def _gone(pid: int) -> bool:
    """Exited (a zombie counts: its CUDA context is gone, only the exit status waits for a reaper)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _wait_for(cond, what: str, limit_s: float = 15.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"not reached within {limit_s} s: {what}")


def test_real_helper_holds_and_releases_a_context_on_the_fake_driver(fake_cuda):
    h = BoostHolder("GPU-fake", timeout_s=20)
    try:
        assert h.set(True) >= 0.0 and h.held and h.alive()
        assert "cuDevicePrimaryCtxRetain" in _calls(fake_cuda) and "cuDevicePrimaryCtxRelease_v2" not in _calls(fake_cuda)
        assert h.set(False) >= 0.0 and not h.held
        assert _calls(fake_cuda)[-1] == "cuDevicePrimaryCtxRelease_v2"
        pid = h.pid
    finally:
        h.close()
    assert _gone(pid)
    with pytest.raises(BoostUnavailable, match="closed"):
        h.set(True)  # closed holders never start another helper


def test_helper_killed_while_holding_is_noticed_and_restarted_then_given_up(fake_cuda, caplog):
    """SIGKILL of the helper takes the boost with it: the controller must not keep reporting it
    held, must get it back while the engine works, and give up after MAX_RESTARTS deaths."""
    h = BoostHolder("GPU-fake", timeout_s=20)
    ctl = BoostController(h, release_after_s=600.0)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm_powersave"):
            ctl.on_busy()
            _wait_for(lambda: ctl.held, "first hold")
            seen = {h.pid}
            for n in range(1, BoostController.MAX_RESTARTS + 1):
                os.kill(h.pid, signal.SIGKILL)
                _wait_for(lambda: not h.alive(), "helper dead")
                ctl.tick()  # the publisher's periodic tick
                _wait_for(lambda n=n: ctl.restarts == n and ctl.held and h.alive(), f"restart {n}")
                assert h.pid not in seen and ctl.snapshot()["held"] is True
                seen.add(h.pid)
            assert _calls(fake_cuda).count("cuDevicePrimaryCtxRetain") == 1 + BoostController.MAX_RESTARTS
            os.kill(h.pid, signal.SIGKILL)
            _wait_for(lambda: not h.alive(), "helper dead")
            ctl.tick()
            _wait_for(lambda: ctl.disabled_reason is not None, "given up")
        assert not ctl.held and ctl.snapshot()["held"] is False and "died 4 times" in ctl.disabled_reason
        assert sum("died while holding" in r.message for r in caplog.records) == BoostController.MAX_RESTARTS
        ctl.on_busy()
        ctl.tick()
        time.sleep(0.1)
        assert not h.alive()  # disabled: no fifth helper
    finally:
        ctl.close()


def test_hanging_helper_times_out_is_killed_and_stays_off(fake_cuda, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_HANG_ON", "cuCtxSynchronize")
    h = BoostHolder("GPU-fake", timeout_s=1.0)
    with pytest.raises(BoostUnavailable, match="TimeoutError"):
        h.set(True)
    assert not h.held and h.pid is None and h.broken
    pids = [int(line.split()[0]) for line in fake_cuda.read_text().splitlines()]
    assert pids and all(_gone(p) for p in set(pids))
    with pytest.raises(BoostUnavailable):
        h.set(True)
    h.close()


def test_driver_error_on_hold_is_reported_not_retried(fake_cuda, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_FAIL_ON", "cuMemAlloc_v2")
    h = BoostHolder("GPU-fake", timeout_s=20)
    with pytest.raises(BoostUnavailable, match="cuMemAlloc returned CUDA error 2"):
        h.set(True)
    assert not h.held and not h.alive()
    h.close()


def test_close_during_a_hung_hold_ends_the_helper_and_the_thread(fake_cuda, monkeypatch, caplog):
    """close() (atexit, engine shutdown) while the loop thread waits for a hold that never
    answers: the helper is ended, the thread finishes, and no failure warning is logged."""
    monkeypatch.setenv("FAKE_CUDA_HANG_ON", "cuCtxSynchronize")
    h = BoostHolder("GPU-fake", timeout_s=60.0)
    ctl = BoostController(h, release_after_s=600.0)
    with caplog.at_level(logging.WARNING, logger="vllm_powersave"):
        ctl.on_busy()
        _wait_for(lambda: "cuCtxSynchronize" in _calls(fake_cuda), "hold in flight")
        pid = int(fake_cuda.read_text().split()[0])
        ctl.close()
    assert not ctl._thread.is_alive() and not ctl.held
    _wait_for(lambda: _gone(pid), "helper ended")
    assert not [r for r in caplog.records if "side context failed" in r.message]
    with pytest.raises(BoostUnavailable, match="closed"):
        h.set(True)


PARENT = textwrap.dedent("""
    import os, sys, time
    from vllm_powersave.clocks.boost import BoostHolder
    h = BoostHolder("GPU-fake", timeout_s=20)
    h.set(True)
    child = 0
    if sys.argv[1] == "fork":
        child = os.fork()  # a forked (not exec'd) child inherits the write end of the helper's stdin
        if child == 0:
            time.sleep(120)
            os._exit(0)
    print(h.pid, child, flush=True)
    time.sleep(120)
""")


@pytest.mark.parametrize("mode", ["plain", "fork"])
def test_parent_sigkill_ends_the_helper(fake_cuda, mode):
    """The server's worker dies by SIGKILL: its boost helper must exit (dropping the context),
    also when a process the worker forked keeps the helper's stdin pipe open."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        helper, child = (int(x) for x in parent.stdout.readline().split())
        assert not _gone(helper)
        parent.kill()
        parent.wait()
        _wait_for(lambda: _gone(helper), f"helper {helper} exits after its parent's SIGKILL ({mode})")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass


ECHO = "import sys\nfor line in sys.stdin:\n    print('ok 0.5', flush=True)\n"


class ScriptHolder(BoostHolder):
    def __init__(self, script: str) -> None:
        super().__init__("GPU-fake", timeout_s=5)
        self.script = script
        self.started = 0

    def _start(self):
        self.started += 1
        return subprocess.Popen([sys.executable, "-c", self.script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)


@pytest.mark.parametrize("answer", ["ok", "ok fast", "okay 1.0", "\\x00\\x01", "err"])
def test_garbage_answers_break_the_holder_cleanly(answer):
    h = ScriptHolder(f"import sys\nsys.stdin.readline()\nprint({answer!r}, flush=True)\nsys.stdin.readline()\n")
    with pytest.raises(BoostUnavailable, match="boost helper"):
        h.set(True)
    assert not h.held and h.broken and h.pid is None
    h.close()


def test_thousands_of_busy_idle_flips_end_consistent():
    """Steps and idle ticks from two threads, 2000 times: the holder never disagrees with the
    controller once settled, one helper serves all switches, and the last word wins."""
    h = ScriptHolder(ECHO)
    t = [0.0]
    ctl = BoostController(h, release_after_s=1.0, clock=lambda: t[0])
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ctl.tick()

    th = threading.Thread(target=ticker)
    th.start()
    try:
        for _ in range(2000):
            t[0] += 5.0  # past the dwell: the next tick releases
            ctl.on_busy()
        stop.set()
        th.join()
        ctl.on_busy()  # the engine is busy at the end
        _wait_for(lambda: ctl.held and not ctl.pending, "held at the end")
        assert h.held and h.started == 1 and ctl.switches == h.switches and ctl.switches % 2 == 1
        t[0] += 5.0
        ctl.tick()
        _wait_for(lambda: not ctl.held and not ctl.pending, "released after the dwell")
        assert not h.held and ctl.switches == h.switches and ctl.disabled_reason is None
    finally:
        stop.set()
        ctl.close()


def test_step_racing_a_release_keeps_the_boost():
    """tick() decided to release, then a step arrived before the loop acted: no release."""
    h = ScriptHolder(ECHO)
    t = [100.0]
    ctl = BoostController(h, release_after_s=1.0, clock=lambda: t[0])
    try:
        ctl.on_busy()
        _wait_for(lambda: ctl.held and not ctl.pending, "held")
        ctl._ev.clear()
        t[0] += 2.0
        ctl.want = False  # what tick() writes ...
        ctl.last_busy = t[0]  # ... while a step lands (on_busy sees want still True: no event)
        ctl._ev.set()
        _wait_for(lambda: ctl.want and not ctl.pending, "the loop re-checked the dwell")
        assert ctl.held and h.held and h.switches == 1
    finally:
        ctl.close()


@pytest.mark.parametrize(
    "value,needle",
    [
        (float("nan"), "finite"),
        (float("inf"), "finite"),
        ("inf", "valid number"),
        (0.01, "greater than or equal to 0.25"),
        (-1, "greater than or equal to 0.25"),
        ("2 s", "valid number"),
        (7200, "less than or equal to 3600"),
    ],
)
def test_bad_release_after_values_are_one_line_errors(value, needle):
    from vllm_powersave.settings import SettingsError, load_settings

    with pytest.raises(SettingsError) as e:
        load_settings({"cuda_perf_boost": "auto", "boost_release_after_s": value}, env={})
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("powersave setting 'boost_release_after_s' = ") and needle in msg


def test_close_while_a_helper_is_being_started_leaves_no_helper_behind():
    """close() does not wait for set()'s lock: a helper started just after it must be ended, not
    left holding the boost until the worker exits."""
    started = []

    class RacingHolder(ScriptHolder):
        def _start(self):
            p = super()._start()
            started.append(p)
            t = threading.Thread(target=self.close)  # shutdown lands while the helper starts
            t.start()
            t.join()
            return p

    h = RacingHolder(ECHO)
    with pytest.raises(BoostUnavailable, match="closed"):
        h.set(True)
    started[0].wait(timeout=10)
    assert started[0].returncode is not None and not h.held and h.pid is None
