"""Shared pieces of the benchmark scripts: :mod:`.stats` (95 % intervals of per-pair ratios),
:mod:`.device` (the dry-run guard, JSON and records, the model bundle), :mod:`.serve` (vLLM servers:
port guard, health, stop) and :mod:`.load` (load windows, the GPU sampler, the plugin's figures)."""
