"""Peak bytes of tensor storage that torch ops allocate (CPU), for the chunking tests and
``benchmarks/lmhead_memory.py``: torch keeps no allocator statistics for CPU memory
(``torch.cuda.max_memory_allocated`` is CUDA's only)."""

from __future__ import annotations

import weakref
from typing import Any

import torch


class LiveTensorBytes:
    """Peak bytes of tensor storage allocated by torch ops inside the ``with`` block (CPU).

    Every op is observed through a ``TorchDispatchMode``: an op output whose storage is not one of
    the op's inputs' is a new allocation, freed when the last tensor seen on it is collected.
    Workspace that a kernel allocates and frees inside one op (oneDNN scratch) is not seen, in
    either arm of a comparison alike. ``peak``: the largest sum of live bytes seen; ``now``: the
    bytes still live.
    """

    def __init__(self) -> None:
        self.now = self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage data_ptr -> [tensor references, bytes]
        self._mode: Any = None

    def _release(self, key: int) -> None:
        ref = self._refs.get(key)
        if ref is None:
            return
        ref[0] -= 1
        if ref[0] == 0:
            self.now -= ref[1]
            del self._refs[key]

    def _seen(self, out: Any, inputs: set[int]) -> None:
        from torch.utils._pytree import tree_flatten

        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            st = t.untyped_storage()
            key = st.data_ptr()
            if key in self._refs:
                self._refs[key][0] += 1
            elif key in inputs or st.nbytes() == 0:
                continue  # a view or an out= argument of something allocated before
            else:
                self._refs[key] = [1, st.nbytes()]
                self.now += st.nbytes()
                self.peak = max(self.peak, self.now)
            weakref.finalize(t, self._release, key)

    def __enter__(self) -> LiveTensorBytes:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
                out = func(*args, **(kwargs or {}))
                tracker._seen(out, inputs)
                return out

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
