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
. benchmarks/h200/job_steps.sh || exit 2
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
    sanitize) sanitize_steps ;;
    sweep)
      step sweep "${T_SWEEP:-300}" python3 benchmarks/moe_kernel.py --sweep --shards tp8 --tokens 64,512,1024,4096 \
        --layers 2 --json "$OUT/sweep_tiled.json" ;;
  esac
done
