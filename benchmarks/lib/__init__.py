"""Shared pieces of the benchmark scripts.

* :mod:`.stats`: 95 % confidence intervals of a mean and of a mean ratio over A/B pairs;
* :mod:`.ab`: the ABBA order of A/B windows and the per-pair ratios;
* :mod:`.energy`: energy / power / SM-clock windows read through the plugin's own NVML meters;
* :mod:`.device`: the guard every device script calls first, JSON writing, the model bundle;
* :mod:`.serve`: vLLM OpenAI servers for the A/B runs (ports, health, CPU pinning).
"""
