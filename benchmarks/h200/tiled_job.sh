#!/usr/bin/env bash
# H200 calls for the "tiled" layout (improvements/15, 2026-12-03): what its session ran, and what it left to run.
#   OUT=dir bash benchmarks/h200/tiled_job.sh ab widths          # same-run A/B tiled vs placed (TP8, TP4, TP1) and
#                                                                # GEMM1's load widths under this GPU's Triton
#   OUT=dir bash benchmarks/h200/tiled_job.sh tests sanitize     # the tiled GPU tests (comparisons tightened after
#                                                                # the session's run), memcheck at H = 768, racecheck
#   OUT=dir bash benchmarks/h200/tiled_job.sh sweep              # GEMM1 tiles re-swept on the tiled layout
# Ran in session 14: ab + widths (e06a25f), then run_moe_h200.sh tests memcheck bench (15e92ed). Left: tests sanitize
# sweep, and the Marlin table (run_moe_h200.sh bench with the shipped vLLM, benchmarks/h200_vllm/).
set -u
: "${OUT:?OUT=dir (where the results go) is required}"
. benchmarks/gpu_deps.sh || exit 2
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
L=$OUT/logs; mkdir -p "$L"
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$L/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $((SECONDS - t0))s"; grep -E "${GREP:-passed|failed|FAIL|Error|best|ERROR}" "$L/$name.log" | tail -${TAIL:-30}; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu,power.draw --format=csv,noheader
for s in "$@"; do
  case $s in
    ab)
      GREP="default|tiled|placed" step ab_tp8 "${T_AB:-300}" python3 benchmarks/moe_variants.py --shards tp8 \
        --tokens 1,2,4,16,64,256,512,1024,4096 --routings balanced,same_k --forms placed --json "$OUT/variants_tiled_tp8.json"
      GREP="default|tiled|placed" step ab_tp4_tp1 "${T_AB1:-180}" python3 benchmarks/moe_variants.py --shards tp4,tp1 \
        --tokens 1,2,4,64,512,1024 --routings balanced,same_k --layers 2 --forms placed \
        --json "$OUT/variants_tiled_tp4_tp1.json" ;;
    widths)
      GREP="regs" step widths "${T_WIDTHS:-120}" python3 benchmarks/aot_ptx.py 1,4,64,512,4096 ;;
    tests)
      # -rA: every test id with its outcome in the log
      step tests "${T_TESTS:-240}" python3 -m pytest tests/gpu/test_moe_kernel_gpu.py -q -rA -p no:cacheprovider \
        -k "tiled or register_capped or weight_tiles_by_tma or cuda_graph" ;;
    sanitize)
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 step memcheck "${T_MEMCHECK:-90}" compute-sanitizer --tool memcheck \
        --print-limit 20 python3 tests/gpu/memcheck_moe_kernel.py
      step racecheck "${T_RACECHECK:-120}" compute-sanitizer --tool racecheck --print-limit 20 \
        python3 tests/gpu/memcheck_moe_kernel.py ;;
    sweep)
      step sweep "${T_SWEEP:-300}" python3 benchmarks/moe_kernel.py --sweep --shards tp8 --tokens 64,512,1024,4096 \
        --layers 2 --json "$OUT/sweep_tiled.json" ;;
  esac
done
