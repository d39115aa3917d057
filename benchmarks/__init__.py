"""Benchmarks of vllm-powersave: scripts that write the records in ``docs/results/``, each run as a module
from the repository root (``python -m benchmarks.NAME``); shared pieces live in :mod:`benchmarks.lib`."""
