#!/usr/bin/env bash
# The test suite (unit tests + an end-to-end test with a real vLLM server), after installing.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
