"""``vllm-powersave tune-serving``: the vLLM configuration with the most tokens per joule that still
meets the user's latency SLO, measured on this machine through a real ``vllm serve`` and the
``loadtests`` harness (docs/tune-serving.md).

One concern per module: ``space`` (the settings and the configurations), ``traffic`` (Poisson,
saturation, trace files), ``slo`` (targets and judging a window), ``search`` (successive halving
and the budget), ``measure`` (one window against one server), ``state`` (the resumable JSON-lines
file), ``report`` (JSON, Markdown, Pareto plot, the winning command line), ``run`` (the driver)
and ``command`` (the argument parser).
"""
