#!/bin/bash
# Runs ON the lent GPU machine, from the repository root, after `.gpu-bundle/device.sh unpack`
# (vLLM in /tmp/site, the plugin's wheel in .whl). Never changes a GPU setting: it exports
# POWERSAVE_FORCE_DRY_RUN=1, and every script refuses to start without it (benchmarks/lib/device.py).
# Usage: bash benchmarks/device_run.sh JOB@GPU...   (jobs run in parallel, each on its own GPU(s))
#   ab05b@G   stock vs plugin, qwen2.5-0.5b, loads 8/64/256, 3 ABBA pairs      (h200-vllm.md)
#   ab7b@G    the same with qwen2.5-7b
#   plp@G     prompt logprobs, 7B, 4000-token prompts: chunk table vs none    (h200-vllm.md)
#   tp2@G,G   TP=2 on two GPUs, stock vs plugin                              (h200x2-tp2.md)
#   pp2@G,G   PP=2 on two GPUs, stock vs plugin
#   meter@G   NVML counter vs instant power, metering cost, attribution      (h200-energy-meter.md)
#   lmhead@G  LM-head chunking grid (raw JSON for benchmarks.lmhead_chunking_record)
set -u
export POWERSAVE_FORCE_DRY_RUN=1 PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false CUDA_DEVICE_ORDER=PCI_BUS_ID \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LIM=${LIM:-570}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/psite .whl/*.whl 2>&1 | grep -v "already exists" | tail -2
nvidia-smi --query-gpu=index,name,uuid,driver_version,power.limit,clocks.sm,temperature.gpu,power.draw --format=csv > "$OUT/gpus.csv" 2>&1
AB="python3 -m benchmarks.h200_ab --budget-s $((LIM-40))"
# Two servers share a GPU: each is told its KV cache size, or the second to profile sees the first's memory.
KV4G="--kv-cache-memory-bytes 4294967296"; KV8G="--kv-cache-memory-bytes 8589934592"
pids=()
for job in "$@"; do
  name=${job%@*}; gpu=${job#*@}
  case $name in
    ab05b)  cmd="$AB --gpus $gpu --shape qwen2.5-0.5b --serve-arg '$KV4G'" ;;
    ab7b)   cmd="$AB --gpus $gpu --shape qwen2.5-7b --serve-arg '$KV8G'" ;;
    plp)    cmd="$AB --gpus $gpu --shape qwen2.5-7b --loads 4,16 --input-len 4000 --output-len 4 --prompt-logprobs 1 --serve-arg '--max-model-len 8192 $KV8G' --a-chunking '[]' --b-chunking '[{\"min_rows\": 1024, \"chunks\": 8}]'" ;;
    tp2)    cmd="$AB --gpus $gpu --shape qwen2.5-7b --serve-arg '--tensor-parallel-size 2 $KV8G'" ;;
    pp2)    cmd="$AB --gpus $gpu --shape qwen2.5-7b --loads 8,64 --serve-arg '--pipeline-parallel-size 2 $KV8G'" ;;
    meter)  cmd="python3 -m benchmarks.h200_energy_meter --gpu $gpu" ;;
    lmhead) cmd="env CUDA_VISIBLE_DEVICES=$gpu python3 -m benchmarks.lm_head_chunking" ;;
    *) echo "unknown job $job"; continue ;;
  esac
  mkdir -p "$OUT/$name"
  echo "start $name on GPU $gpu: $cmd --out $OUT/$name/raw.json"
  ( export PYTHONPATH=/tmp/site; eval timeout -k 10 $LIM $cmd --out "$OUT/$name/raw.json" > "$OUT/$name/log.txt" 2>&1; echo "rc=$?" >> "$OUT/$name/log.txt" ) &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
for d in "$OUT"/*/; do
  echo "== $(basename "$d"): $(tail -1 "$d/log.txt")"; tail -8 "$d/log.txt" | cut -c1-240
  # The device tool brings back a few files per job: the servers' logs travel as one tarball.
  ls "$d"/server-*.log >/dev/null 2>&1 && tar -czf "$d/servers.tar.gz" -C "$d" $(cd "$d" && ls server-*.log) && rm -f "$d"/server-*.log
done
