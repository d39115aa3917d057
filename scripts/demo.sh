#!/usr/bin/env bash
# The main job: stock vLLM vs the plugin's defaults on the tiny model, ABBA order, under a load that
# looks like serving: Poisson arrivals at a moderate rate (idle gaps between requests) and a
# saturation point; one report that says which savings were measured and which predicted.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
case " $* " in
  *" --rates"*) exec .venv/bin/vllm-powersave compare "$@" ;;
  *) exec .venv/bin/vllm-powersave compare --rates 1,inf --rate-window-s 30 "$@" ;;
esac
