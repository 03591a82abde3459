#!/usr/bin/env bash
# H200 calls of 2026-12-04: the dots as mma.sync (sm_120's instruction; Triton's DISABLE_MMA_V3=1, glm5_fp4/bench/mma.py)
# instead of Hopper's wgmma, and the RTX PRO 6000's own plans (configs.plan("sm120", ..., 188 SMs)) run on the H200.
#   OUT=dir bash benchmarks/h200/mma_sync_job.sh tables      # TP8 tables, one process each: this GPU's plans with
#                                                            # wgmma, the same plans with mma.sync, sm_120's plans
#                                                            # with mma.sync (each checks what Triton built)
#   OUT=dir bash benchmarks/h200/mma_sync_job.sh sweep       # sm_120's candidates swept around its plans, mma.sync
#   OUT=dir bash benchmarks/h200/mma_sync_job.sh ab          # same-run A/B of sm_120's plans against its former ones
#                                                            # (opt-in "sm120_former"), TP8 then TP4 / TP1, mma.sync
#   OUT=dir bash benchmarks/h200/mma_sync_job.sh tests       # tests/gpu/test_sm120_plans_gpu.py under mma.sync
#   OUT=dir bash benchmarks/h200/mma_sync_job.sh sanitize    # memcheck + racecheck of the small cases (with sm_120's
#                                                            # plans among them) under mma.sync
# Each table is its own process because Triton's in-memory kernel cache does not key on the variable.
set -u
. benchmarks/h200/job_steps.sh || exit 2
TOKENS=${TOKENS:-1,4,16,64,256,512,1024,4096,8192}
ROUTINGS=${ROUTINGS:-balanced,same_k,zipf1.2}
table() {  # NAME ARGS...: the TP8 table (no Marlin, no grouped baselines) into $OUT/NAME.{json,md}
  local name=$1; shift
  GREP="precompiled|ERROR|error|built|copy" step "$name" "${T_TABLE:-170}" python3 benchmarks/moe_kernel.py \
    --shards "${SHARDS:-tp8}" --tokens "$TOKENS" --routings "$ROUTINGS" --no-marlin --no-baselines --precompile 14 \
    "$@" --json "$OUT/$name.json" --md "$OUT/$name.md"; }
for s in "$@"; do
  case $s in
    tables)
      table sm90_wgmma
      table sm90_mma_sync --mma-sync
      table sm120_mma_sync --plan-arch sm120 --mma-sync
      python3 benchmarks/moe_tables_compare.py "$OUT/sm90_wgmma.json" "$OUT/sm90_mma_sync.json" \
        "$OUT/sm120_mma_sync.json" --labels "sm90 plans wgmma,sm90 plans mma.sync,sm120 plans mma.sync" \
        --md "$OUT/mma_compare.md" ;;
    sweep)  # (the L2-prefetch variants are left out: rejected on the H200, improvements/12)
      GREP="precompiled|best|ERROR|rror" step sweep_sm120 "${T_SWEEP:-540}" python3 benchmarks/moe_kernel.py --sweep \
        --plan-arch sm120 --mma-sync --shards tp8 --tokens "${SWEEP_TOKENS:-1,4,16,64,512,1024,4096}" --layers 2 \
        --only '^(g1|g2|split)' --precompile 14 --json "$OUT/sweep_sm120_standin${SWEEP_TAG:-}.json" ;;
    ab)
      GREP="precompiled|T=|rror" step ab_sm120_tp8 "${T_AB:-300}" python3 benchmarks/moe_variants.py --plan-arch sm120 \
        --mma-sync --precompile 14 --shards tp8 --tokens "${AB_TOKENS:-1,2,4,16,64,256,512,1024,2048,4096,8192}" \
        --routings balanced,same_k --forms "${FORMS:-sm120_former}" --json "$OUT/variants_sm120_standin_tp8.json"
      GREP="precompiled|T=|rror" step ab_sm120_tp4_tp1 "${T_AB1:-200}" python3 benchmarks/moe_variants.py \
        --plan-arch sm120 --mma-sync --precompile 14 --shards tp4,tp1 --tokens "${AB1_TOKENS:-1,4,64,512,4096}" \
        --routings balanced,same_k --layers 2 --forms "${FORMS:-sm120_former}" \
        --json "$OUT/variants_sm120_standin_tp4_tp1.json" ;;
    tests)
      DISABLE_MMA_V3=1 TRITON_CACHE_DIR=/tmp/triton-cache-mma-sync step sm120_tests "${T_TESTS:-240}" \
        python3 -m pytest tests/gpu/test_sm120_plans_gpu.py -q -rA -p no:cacheprovider ;;
    sanitize)
      DISABLE_MMA_V3=1 TRITON_CACHE_DIR=/tmp/triton-cache-mma-sync memcheck_step memcheck_mma_sync
      DISABLE_MMA_V3=1 TRITON_CACHE_DIR=/tmp/triton-cache-mma-sync step racecheck_mma_sync "${T_RACECHECK:-120}" \
        compute-sanitizer --tool racecheck --print-limit 20 python3 tests/gpu/memcheck_moe_kernel.py ;;
  esac
done
