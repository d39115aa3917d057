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
