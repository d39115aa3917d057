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
