import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def server_factory():
    """Start in-process fake OpenAI servers (``loadtests.fake_server``); all are stopped after the test."""
    from loadtests.fake_server import FakeServer

    started: list[FakeServer] = []

    def make(**kw: Any) -> FakeServer:
        s = FakeServer(**kw).start()
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


@pytest.fixture
def tiny_config(tmp_path):
    """A model directory with only the tiny model's config.json (what `tune` and the CLI checks read)."""
    from vllm_powersave.modelgen import SHAPES

    d = tmp_path / "qwen2-tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({k: v for k, v in SHAPES["qwen2-tiny"].items() if not k.startswith("_")}))
    return d


@pytest.fixture(autouse=True, scope="session")
def _no_stale_vllm_cpu_shm():
    """vLLM's CPU backend names its TP shared memory ``/dev/shm/<pid>-tp:...-cpushm_<rank>`` and leaves
    it behind when the engine dies; a later engine that gets the same PID fails to start (EEXIST).
    Remove only segments whose owner PID is gone, once per test session."""
    import os
    import re

    shm = Path("/dev/shm")
    if shm.is_dir():
        for f in shm.iterdir():
            m = re.match(r"^(\d+)-tp:.*-cpushm_\d+$", f.name)
            if not m:
                continue
            try:
                os.kill(int(m.group(1)), 0)
            except ProcessLookupError:
                f.unlink(missing_ok=True)
            except OSError:
                pass  # alive (or not ours to judge): keep it
    yield


@pytest.fixture(autouse=True)
def _fake_cuda_step_timer(monkeypatch):
    """Runtimes built on a fake CUDA device (FakeNvml) time steps with a fake CUDA-event timer:
    this machine's torch has no CUDA. Tests of the timer itself replace it again."""
    from fakes import FakeCudaStepTimer

    from vllm_powersave.runtime import build

    monkeypatch.setattr(build, "CudaEventStepTimer", FakeCudaStepTimer)
