"""Load-test harness for OpenAI-compatible servers that reports tokens per joule.

Public API::

    from loadtests import BenchConfig, run, run_benchmark, format_markdown, compare_table
    result = run(BenchConfig(base_url="http://127.0.0.1:8000", num_prompts=50, max_concurrency=8))
    print(result["output_tokens_per_joule"], result["energy_source"])

Energy comes from the server's ``powersave_gpu_energy_joules_total`` Prometheus counter,
else local NVML, else it is reported as missing (fields None). Fleets (``base_urls``), load shapes,
sweeps (``run_sweep``), datasets, the steady-state window and timelines: see ``loadtests/README.md``.
"""

from __future__ import annotations

from .config import BenchConfig
from .errors import ConfigError, DatasetError, LoadTestError, ServerUnreachableError
from .report import compare_table, format_markdown, format_table, write_result_json
from .runner import run, run_benchmark
from .sweep import format_sweep, run_sweep

__all__ = [
    "BenchConfig",
    "ConfigError",
    "DatasetError",
    "LoadTestError",
    "ServerUnreachableError",
    "compare_table",
    "format_markdown",
    "format_sweep",
    "format_table",
    "run",
    "run_benchmark",
    "run_sweep",
    "write_result_json",
]
