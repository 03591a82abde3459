#!/usr/bin/env bash
# Device calls of improvements/19 (2026-12-05; every call ran on an H100): GEMM2's stages and split along H (the
# 16-token default it found: 12 programs per block in 4 stages), the bounds and per-kernel ncu on the defaults. The
# first sweep (a927a2d) tried GEMM1 in 64-wide K tiles of 6-10 stages ("deep rings": slower everywhere, candidates
# since removed); the splitk step (2cac3f6) and the fused_finalize form (64c404b) were reverted with their code.
#   OUT=dir bash benchmarks/h200/gemm2_split_job.sh sweep   # GEMM2 stage x split candidates, TP8 (SWEEP_TOKENS)
#   OUT=dir bash benchmarks/h200/gemm2_split_job.sh sweep4  # the same at the TP4 shard, T = 64, 256, 512
#   OUT=dir bash benchmarks/h200/gemm2_split_job.sh ab      # same-run A/B default / FORMS / default, TP8 then TP4, TP1
#                                                         # (AB1_TOKENS=none: TP8 only)
#   OUT=dir bash benchmarks/h200/gemm2_split_job.sh diag    # bounds on the defaults (decode left out, GEMM2's atomics as
#                                                         # plain stores, the parallel align) and ncu's per-kernel
#                                                         # durations and DRAM throughput, TP8 T = 64-1024
#   OUT=dir bash benchmarks/h200/gemm2_split_job.sh tests   # tests/gpu: TESTS_K (the GEMM2 split test) against float64
# carry [".whl"] (pydantic for glm5_fp4.hardware: benchmarks/gpu_deps.sh).
set -u
. benchmarks/h200/job_steps.sh || exit 2
ONLY=${SWEEP_ONLY:-^g2 (64x(16|32)w4s[3-8]u )?n[0-9]+$}
for s in "$@"; do
  case $s in
    sweep)
      GREP="precompiled|best|rror" step sweep_deep "${T_SWEEP:-330}" python3 benchmarks/moe_kernel.py --sweep \
        --shards tp8 --tokens "${SWEEP_TOKENS:-64,128,256,512,1024}" --layers 2 --only "$ONLY" \
        --precompile 14 --json "$OUT/sweep_deep.json" ;;
    sweep4)
      GREP="precompiled|best|rror" step sweep_deep_tp4 "${T_SWEEP4:-200}" python3 benchmarks/moe_kernel.py --sweep \
        --shards tp4 --tokens "${SWEEP4_TOKENS:-64,256,512}" --layers 2 --only "$ONLY" \
        --precompile 14 --json "$OUT/sweep_deep_tp4.json" ;;
    diag)
      GREP="precompiled|T=|rror" step diag_bounds "${T_DIAG:-150}" python3 benchmarks/moe_variants.py --precompile 14 \
        --shards tp8 --tokens "${DIAG_TOKENS:-64,256,512,1024}" --routings balanced --forms parallel_align --nodecode \
        --noatomic --json "$OUT/variants_diag_tp8.json"
      for t in ${NCU_TOKENS:-64 256 512}; do
        GREP="rror" step "ncu_tp8_t$t" "${T_NCU:-90}" ncu --clock-control none --profile-from-start off --csv \
          --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__occupancy_limit_registers,sm__warps_active.avg.pct_of_peak_sustained_active \
          python3 benchmarks/ncu_moe_call.py --shard tp8 --tokens "$t"
        cp "$L/ncu_tp8_t$t.log" "$OUT/ncu_tp8_t$t.csv"
      done ;;
    ab)
      GREP="precompiled|T=|rror" step ab_deep_tp8 "${T_AB:-300}" python3 benchmarks/moe_variants.py --precompile 14 \
        --shards tp8 --tokens "${AB_TOKENS:-64,256,512,1024,2048}" --routings "${AB_ROUTINGS:-balanced,same_k}" \
        --forms "${FORMS:?FORMS=opt-in forms to time}" --json "$OUT/variants_deep_tp8.json"
      [ "${AB1_TOKENS:-}" = none ] || GREP="precompiled|T=|rror" step ab_deep_tp4_tp1 "${T_AB1:-200}" python3 benchmarks/moe_variants.py --precompile 14 \
        --shards tp4,tp1 --tokens "${AB1_TOKENS:-512,1024}" --routings balanced,same_k --layers 2 --forms "$FORMS" \
        --json "$OUT/variants_deep_tp4_tp1.json" ;;
    sanitize) sanitize_steps ;;
    tests)
      step tests_deep "${T_TESTS:-240}" python3 -m pytest tests/gpu/test_moe_kernel_gpu.py -q -rA -p no:cacheprovider \
        -k "${TESTS_K:-gemm2_split_along}" ;;
  esac
done
