"""Step timing where the SM clock acts: on the GPU, not on the engine thread.

With vLLM's async scheduling (the default since 0.11) the engine thread launches step *n + 1* while
the GPU still runs step *n*, so the wall time between the runner's ``execute_model`` and
``sample_tokens`` is launch time: on the H200 a ``qwen2.5-7b`` decode step at batch 64 read
1.9-2.9 ms on the engine thread, below the ~3.2 ms it takes just to read the weights once at
4.8 TB/s (docs/results/h200-closed-loop-decisions.md). A clock controller fed those times would
judge clocks by a figure the clock barely moves. Each backend here gives a step's duration as the
device sees it:

* :class:`CudaEventStepTimer` (real): two CUDA timing events on the engine thread's current stream,
  one where the step is launched and one after its sampling; their elapsed time is the step's
  span on the GPU (from the end of the work queued before it to the end of its own). The engine
  thread reads them at a later step start, once the GPU has passed them (``query``), and reuses
  them; no other thread makes a CUDA call (``runtime/step.py``, ``_read_step_times``).
* :class:`SimulatedStepTimer`: the simulated GPU's time for the step (labelled ``simulated``).
* ``None`` (no timer): the engine-thread wall time, right where execution is synchronous (vLLM's
  CPU build); :data:`WALL` names that source.

A timer has no dry-run variant: it reads and never sets anything.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

#: ``step_time_source`` of the engine-thread wall time (no timer).
WALL = "engine_wall"
#: Event pairs kept for reuse; steps in flight beyond this allocate (and drop) their own.
_POOL_MAX = 1024


class CudaEventStepTimer:
    """Times steps with CUDA events on the current stream (``torch.cuda.Event(enable_timing=True)``).

    Every method runs on the engine thread: ``start``/``stop`` record one event each,
    ``elapsed_ms`` queries and reads a pair, ``release`` gives it back.
    """

    source = "cuda_events"

    def __init__(self, device_index: int) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available")
        self._torch = torch
        self._event = torch.cuda.Event
        self._device_index = device_index
        self._free: deque[tuple[Any, Any]] = deque()
        # ``Event.record()`` with no stream builds a ``torch.cuda.Stream`` object for the current
        # stream on every call, most of its host cost (docs/results/h200-step-timer.md). The
        # current stream's id is a cheap C call: the Stream object is rebuilt only when it changes.
        self._current_id = getattr(torch._C, "_cuda_getCurrentStream", None)
        self._record = getattr(getattr(torch._C, "_CudaEventBase", None), "record", None)
        self._stream_key: Any = None
        self._stream: Any = None
        # torch creates a CUDA event at its first record, so a fault shows at the first start(),
        # where the step path catches it and turns the closed loop off.
        self._free.append(self._pair())

    def _pair(self) -> tuple[Any, Any]:
        return (self._event(enable_timing=True), self._event(enable_timing=True))

    def _record_now(self, event: Any) -> None:
        """Record ``event`` on the engine thread's current stream."""
        if self._current_id is None or self._record is None:
            event.record()  # a torch without the private fast path: the public call
            return
        key = self._current_id(self._device_index)
        if key != self._stream_key:
            self._stream = self._torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
            self._stream_key = key
        self._record(event, self._stream)

    def start(self) -> tuple[Any, Any]:
        """Mark a step's launch; returns the mark to pass to :meth:`stop`."""
        free = self._free
        mark = free.pop() if free else self._pair()
        self._record_now(mark[0])
        return mark

    def stop(self, mark: tuple[Any, Any]) -> None:
        """Mark the end of the step's work (after its sampling was launched)."""
        self._record_now(mark[1])

    def elapsed_ms(self, mark: tuple[Any, Any]) -> float | None:
        """The step's span on the GPU (ms), or ``None`` while the GPU has not reached its end."""
        if not mark[1].query():
            return None
        return float(mark[0].elapsed_time(mark[1]))

    def release(self, mark: tuple[Any, Any]) -> None:
        """Give a mark back for reuse (after :meth:`elapsed_ms` answered, or for a step never stopped)."""
        if len(self._free) < _POOL_MAX:
            self._free.append(mark)


class SimulatedStepTimer:
    """The simulated GPU's step time: the publisher reports it with :meth:`set_ms` once it priced
    the step (``SimulatedGpu.run``); every figure from it is ``simulated``. A step it never priced
    reads NaN (no measurement), never ``None`` (which would mean "not finished yet")."""

    source = "simulated"

    def start(self) -> list[float]:
        return [math.nan]

    def stop(self, mark: list[float]) -> None:
        pass

    def set_ms(self, mark: list[float], step_ms: float) -> None:
        mark[0] = step_ms

    def elapsed_ms(self, mark: list[float]) -> float | None:
        return mark[0]

    def release(self, mark: list[float]) -> None:
        pass


StepTimer = CudaEventStepTimer | SimulatedStepTimer
