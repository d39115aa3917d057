#!/bin/bash
# Runs ON the lent H200 machine(s), from the repository root, after `.gpu-bundle/device.sh unpack`.
# Never changes a GPU setting: POWERSAVE_FORCE_DRY_RUN=1 is forced, and every script refuses without it.
# Usage: bash benchmarks/device_run.sh JOB...   (jobs run in parallel, each on its own GPU)
#   JOB: boost1@GPU | boostA@GPU | boostB@GPU | boostC@GPU | boostD@GPU | auto@GPU | meterg@GPU | ab05b@GPU | plp@GPU (prompt logprobs: chunk policy vs none) | bisect2@GPU (0.5B overhead: one plugin option off per server) | cross@0,1 (stock and plugin at once on two GPUs, placements swapped, CPU sets rotated; CROSS_SHAPE, CROSS_LOADS, CROSS_PAIRS, CROSS_ARMS=twin,full,bare) | bisectc@GPU (stock, stock twin, plugin driven at once; CPU sets rotated; BC_CONC=8) | prof@GPU (stock and full plugin, 1 round, then py-spy on both processes of each) | bisect_meter@GPU | meter@GPU | altoff@GPU / altsrv@GPU / althooks@GPU (the plugin's hooks timed in-process; ALT_HOOK_ARMS=stock,full,full-base with an earlier wheel in .whl-base; fast alternation of arms on one GPU, offline LLM / OpenAI server; ALT_ARMS, ALT_OFF_LOADS, ALT_SRV_LOADS, ALT_BURST) | nvmlx@GPU[,OTHER] (NVML reads vs a decode-like loop on the same GPU) | lmhead@GPU | tp2@GPUS (e.g. tp2@0,1) | pp2@GPUS | benchcmp@GPU (loadtests vs vllm bench serve, stock server)
set -u
export POWERSAVE_FORCE_DRY_RUN=1 PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false CUDA_DEVICE_ORDER=PCI_BUS_ID \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s); ts() { echo "[run +$(( $(date +%s)-T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/psite .whl/*.whl 2>&1 | grep -v "already exists" | tail -2
# An earlier build of ours in .whl-base (optional) goes to /tmp/psite-base: h200_alternate's X-base arms run it (before/after in one call).
[ -d .whl-base ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/psite-base .whl-base/*.whl 2>&1 | grep -v "already exists" | tail -2
# py-spy (for the bisect's GIL profile) travels as a wheel in .whl beside ours; without it the bisect skips profiling.
ts "wheel installed: $(ls /tmp/psite | grep -c powersave) entries; py-spy: $(ls /tmp/psite/bin/py-spy 2>/dev/null || echo absent)"
nvidia-smi --query-gpu=index,name,uuid,driver_version,power.limit,clocks.sm,temperature.gpu,power.draw --format=csv > "$OUT/gpus.csv" 2>&1
LIM=${LIM:-570}
pids=()
for job in "$@"; do
  name=${job%@*}; gpu=${job#*@}
  case $name in
    boostA) cmd="python3 benchmarks/h200_perf_boost.py --gpu $gpu --order on,off --tag part2-gpu$gpu --budget-s $((LIM-15)) --out $OUT/$name/raw.json" ;;
    boostB) cmd="python3 benchmarks/h200_perf_boost.py --gpu $gpu --order off,on --booster 1 --tag part2-gpu$gpu --budget-s $((LIM-15)) --out $OUT/$name/raw.json" ;;
    boostC) cmd="python3 benchmarks/h200_perf_boost.py --gpu $gpu --order off,on --long-idle 1 --tag ${name}-gpu$gpu-$(date +%m%d%H%M) --budget-s $((LIM-15)) --out $OUT/$name/raw.json" ;;
    boostD) cmd="python3 benchmarks/h200_perf_boost.py --gpu $gpu --order on,off --tag ${name}-gpu$gpu-$(date +%m%d%H%M) --budget-s $((LIM-15)) --out $OUT/$name/raw.json" ;;
    auto)   cmd="python3 benchmarks/h200_perf_boost.py --gpu $gpu --order auto --long-idle 0 --tag auto-gpu$gpu --budget-s $((LIM-15)) --out $OUT/$name/raw.json" ;;
    meterg) cmd="env PYTHONPATH=/tmp/psite:/tmp/site python3 benchmarks/h200_energy_meter.py --gpu $gpu --parts bgr,bg --pairs 12 --out $OUT/$name/raw.json" ;;
    boost1) cmd="python3 benchmarks/h200_perf_boost.py --gpu $gpu --order off,on,on --long-idle 0 --booster 1 --tag part1 --budget-s $((LIM-15)) --out $OUT/boost1/raw.json" ;;
    # Two servers start on one GPU at once: each must be told its KV cache size, or the second to profile
    # sees the first's memory and gets a negative budget (session 5: ab05b failed so; plp, tp2, pp2 set it too).
    ab05b)  cmd="python3 benchmarks/h200_ab.py --gpus $gpu --shape qwen2.5-0.5b --loads 8,64,256 --pairs 3 --serve-arg '--kv-cache-memory-bytes 4294967296' --budget-s $((LIM-40)) --out $OUT/ab05b/raw.json" ;;
    plp)    cmd="python3 benchmarks/h200_ab.py --gpus $gpu --shape qwen2.5-7b --loads 4,16 --pairs 3 --input-len 4000 --output-len 4 --prompt-logprobs 1 --serve-arg '--max-model-len 8192 --kv-cache-memory-bytes 8589934592' --a-chunking '[]' --b-chunking '[{\"min_rows\": 1024, \"chunks\": 8}]' --budget-s $((LIM-40)) --out $OUT/$name/raw.json" ;;
    pp2)    cmd="python3 benchmarks/h200_ab.py --gpus $gpu --shape qwen2.5-7b --loads 8,64 --pairs 3 --gpu-mem 0.42 --serve-arg '--pipeline-parallel-size 2 --kv-cache-memory-bytes 8589934592' --budget-s $((LIM-40)) --out $OUT/pp2/raw.json" ;;
    benchcmp) cmd="python3 benchmarks/h200_bench_compare.py --gpu $gpu --budget-s $((LIM-90)) ${BENCHCMP_ARGS:-} --out $OUT/$name/raw.json" ;;
    tp2)    cmd="python3 benchmarks/h200_ab.py --gpus $gpu --shape qwen2.5-7b --loads 8,64,256 --pairs 3 --gpu-mem 0.42 --serve-arg '--tensor-parallel-size 2 --kv-cache-memory-bytes 8589934592' --budget-s $((LIM-40)) --out $OUT/tp2/raw.json" ;;
    bisect2) cmd="python3 benchmarks/h200_overhead_bisect.py --gpu $gpu --variants S0,S1,S3,S4,S5,S6 --gpu-mem 0.14 --rounds 4 --budget-s $((LIM-20)) --out $OUT/$name/raw.json" ;;
    cross)  cmd="python3 benchmarks/h200_ab_cross.py --gpus $gpu --shape ${CROSS_SHAPE:-qwen2.5-0.5b} --loads ${CROSS_LOADS:-8,64,256} --pairs ${CROSS_PAIRS:-3} --arms ${CROSS_ARMS:-full} --gpu-mem ${CROSS_GPU_MEM:-0.42} --budget-s $((LIM-25)) --out $OUT/$name/raw.json" ;;
    bisectc) cmd="python3 benchmarks/h200_overhead_bisect.py --gpu $gpu --variants S0,S7,S1 --concurrent --concurrency ${BC_CONC:-8} --gpu-mem 0.2 --rounds 60 --window 10 --budget-s $((LIM-20)) --out $OUT/$name/raw.json" ;;
    prof)   cmd="python3 benchmarks/h200_overhead_bisect.py --gpu $gpu --variants S0,S1 --gpu-mem 0.3 --rounds 1 --budget-s $((LIM-10)) --out $OUT/$name/raw.json" ;;
    bisect_meter) cmd="python3 benchmarks/h200_overhead_bisect.py --gpu $gpu --budget-s 330 --out $OUT/$name/bisect.json; env PYTHONPATH=/tmp/psite:/tmp/site python3 benchmarks/h200_energy_meter.py --gpu $gpu --windows 2:3,5:2,10:2,30:1 --pairs 4 --pair-window 3 --out $OUT/$name/meter.json" ;;
    meter)  cmd="env PYTHONPATH=/tmp/psite:/tmp/site python3 benchmarks/h200_energy_meter.py --gpu $gpu --out $OUT/meter/raw.json" ;;
    altoff) cmd="python3 benchmarks/h200_alternate.py --mode offline --gpu $gpu --shape ${ALT_SHAPE:-qwen2.5-0.5b} --arms ${ALT_ARMS:-stock,twin,bare,full} --loads ${ALT_OFF_LOADS:-8,64} --output-len 512 --budget-s $((LIM-30)) --out $OUT/$name/raw.json" ;;
    althooks) cmd="python3 benchmarks/h200_alternate.py --mode offline --time-hooks ${ALT_HOOK_EXTRA:-} --gpu $gpu --shape ${ALT_SHAPE:-qwen2.5-0.5b} --arms ${ALT_HOOK_ARMS:-stock,bare,full} --loads ${ALT_HOOK_LOADS:-8,64,256} --output-len 256 --budget-s ${ALT_HOOK_BUDGET:-240} --out $OUT/$name/raw.json" ;;
    altsrv) cmd="python3 benchmarks/h200_alternate.py --mode serve --gpu $gpu --shape ${ALT_SHAPE:-qwen2.5-0.5b} --arms ${ALT_ARMS:-stock,twin,bare,full} --loads ${ALT_SRV_LOADS:-8} --burst ${ALT_BURST:-32} --output-len 256 --budget-s $((LIM-30)) --out $OUT/$name/raw.json" ;;
    nvmlx)  cmd="python3 benchmarks/h200_nvml_interference.py --gpu ${gpu%%,*} $([[ $gpu == *,* ]] && echo --other-gpu ${gpu#*,}) --rounds ${NX_ROUNDS:-3} --window ${NX_WINDOW:-6} --out $OUT/$name/raw.json" ;;
    lmhead) cmd="env PYTHONPATH=/tmp/psite:/tmp/site ${LMHEAD_CMD:-python3 benchmarks/lm_head_chunking.py} --out $OUT/lmhead/raw.json" ;;
    *) ts "unknown job $job"; continue ;;
  esac
  mkdir -p "$OUT/$name"
  ts "start $name on GPU $gpu: $cmd"
  ( export PYTHONPATH=/tmp/site; eval timeout -k 10 $LIM $cmd > "$OUT/$name/log.txt" 2>&1; echo "rc=$?" >> "$OUT/$name/log.txt" ) &
  pids+=($!)
done
for p in "${pids[@]}"; do wait $p; done
for d in "$OUT"/*/; do
  ts "== $(basename $d): $(tail -1 $d/log.txt)"; grep -E "^\[(ab|meter|run)" "$d/log.txt" | tail -14 | cut -c1-260
  for f in "$d"/server-*.log; do [ -f "$f" ] && grep -E "Traceback|Error|error" "$f" | tail -3 | cut -c1-200; done
  # The device tool brings back at most 8 files: one tarball of server logs per job keeps a job to 3 (log, raw, servers).
  ls "$d"/server-*.log >/dev/null 2>&1 && tar -czf "$d/servers.tar.gz" -C "$d" $(cd "$d" && ls server-*.log) && rm -f "$d"/server-*.log
done
ts "done"
