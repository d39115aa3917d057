#!/usr/bin/env bash
# The main job: vLLM on the tiny model with the plugin off, then on; one load test each; one table.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/vllm-powersave compare "$@"
