"""Benchmarks of vllm-powersave: scripts that write the records in ``docs/results/``.

Run each as a module from the repository root, e.g. ``python -m benchmarks.sim_clock_presets``.
Shared pieces (confidence intervals, GPU facts, device-job guard, vLLM servers) live in
:mod:`benchmarks.lib`.
"""
