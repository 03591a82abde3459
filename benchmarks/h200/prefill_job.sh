#!/usr/bin/env bash
# The 2026-12-02 prefill job (issue 13 goal 3; issue 16's TP1 prefill question), run in the background by
# benchmarks/device_bg.sh while vLLM's pieces arrive: the config sweep at prefill sizes (TP8 and TP1 whole
# experts, every sweep variant precompiled in parallel first), then, once install.sh has put vLLM on /tmp/site,
# the tables with Marlin beside ours and torch's bf16 grouped GEMM in the same run, using the sweep's best plans.
set -u
. benchmarks/gpu_deps.sh || exit 2
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
J=${PRECOMPILE_JOBS:-12}
mkdir -p "$OUT/logs"
run() { local name=$1; shift; local t0=$SECONDS; timeout "${LIMIT:-900}" python3 "$@" > "$OUT/logs/$name.log" 2>&1
        echo "== $name rc=$? $((SECONDS - t0)) s"; grep -E "best|precompiled|Error|error" "$OUT/logs/$name.log" | tail -20; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
run sweep_tp8 benchmarks/moe_kernel.py --sweep --precompile "$J" --shards tp8 --tokens ${TP8_TOKENS:-2048,4096,8192} \
    --layers 2 --json "$OUT/sweep_tp8.json"
run sweep_tp1 benchmarks/moe_kernel.py --sweep --precompile "$J" --shards tp1 --tokens ${TP1_TOKENS:-2048,8192} \
    --layers 2 --json "$OUT/sweep_tp1.json"
# what limits the prefill kernels: Nsight Compute on one T=8192 TP8 call, default plan and the sweep's best
ncu_one() { local name=$1; shift; timeout 240 ncu --clock-control none --profile-from-start off --section SpeedOfLight \
    --section Occupancy --section WarpStateStats --section LaunchStats --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --csv --page details python3 benchmarks/ncu_moe_call.py "$@" > "$OUT/$name.csv" \
    2> "$OUT/logs/$name.err"; echo "== $name rc=$?"; }
ncu_one ncu_tp8_t8192 --shard tp8 --tokens 8192
ncu_one ncu_tp8_t8192_best --shard tp8 --tokens 8192 --plans "$OUT/sweep_tp8.json"
# Marlin needs the shipped vLLM
. benchmarks/h200_vllm/wait_env.sh
run table_tp8 benchmarks/moe_kernel.py --shards tp8 --tokens 2048,4096,8192 --routings balanced,same_k,zipf1.2 \
    --layers 2 --stages --plans "$OUT/sweep_tp8.json" --json "$OUT/prefill_tp8.json" --md "$OUT/logs/prefill_tp8.md"
run table_tp1 benchmarks/moe_kernel.py --shards tp1 --tokens 1024,2048,4096,8192 --routings balanced,zipf1.2 \
    --layers 2 --plans "$OUT/sweep_tp1.json" --json "$OUT/prefill_tp1.json" --md "$OUT/logs/prefill_tp1.md"
echo 0 > /tmp/bg/rc
