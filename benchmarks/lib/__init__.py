"""Shared pieces of the benchmark scripts.

* :mod:`.stats`: the 95 % confidence interval of a mean (per-pair ratios of A/B runs);
* :mod:`.energy`: the GPU's facts for a record, through the plugin's device layer;
* :mod:`.device`: the guard every device script calls first, JSON writing, the model bundle;
* :mod:`.serve`: vLLM OpenAI servers for the A/B runs (port guard, health, stop).
"""
