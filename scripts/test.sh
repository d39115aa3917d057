#!/usr/bin/env bash
# The test suite (unit tests + an end-to-end test with a real vLLM server), after installing.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Lint and format first (pyproject.toml [tool.ruff]): a finding fails the run before the tests start.
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest -q "$@"
