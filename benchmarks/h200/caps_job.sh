#!/usr/bin/env bash
# One H200 call (2026-12-03): the new sm90 tile defaults against their former forms in the same run, their GPU
# tests, memcheck, and ncu's stall reasons of the T=512 call. OUT=dir bash benchmarks/h200/caps_job.sh
set -u
: "${OUT:?OUT=dir (where the results go) is required}"
. benchmarks/gpu_deps.sh || exit 2
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
L=$OUT/logs; mkdir -p "$L"
t0=$SECONDS
timeout 200 python3 benchmarks/moe_variants.py --shards tp8,tp4 --tokens 1,2,4,512,1024 --routings balanced,same_k \
  --forms slot_stages4,gemm2_128x32 --json "$OUT/variants_caps.json" > "$L/variants.log" 2>&1
echo "== variants rc=$? $((SECONDS - t0))s"; grep -E "T=" "$L/variants.log"
t0=$SECONDS
timeout 220 python3 -m pytest tests/gpu/test_moe_kernel_gpu.py -q -p no:cacheprovider -k "register_capped or pdl_matches \
or fused_split_k or cuda_graph or torch_compile or balanced_matches or (skewed_routings and not 8192)" > "$L/tests.log" 2>&1
echo "== tests rc=$? $((SECONDS - t0))s"; tail -4 "$L/tests.log"
t0=$SECONDS
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 90 compute-sanitizer --tool memcheck --print-limit 20 \
  python3 tests/gpu/memcheck_moe_kernel.py > "$L/memcheck.log" 2>&1
echo "== memcheck rc=$? $((SECONDS - t0))s"; tail -2 "$L/memcheck.log"
t0=$SECONDS
timeout 90 ncu --clock-control none --profile-from-start off --csv --page raw \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__warps_active.avg.per_cycle_active,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed" \
  python3 benchmarks/ncu_moe_call.py --shard tp8 --tokens 512 > "$L/ncu_stalls_t512.csv" 2>&1
echo "== ncu rc=$? $((SECONDS - t0))s"
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs
