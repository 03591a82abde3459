#!/usr/bin/env bash
# Device calls of improvements/22 (GEMM1's programs ask L2 for their expert's GEMM2 weights, Plan.gemm1_w2_prefetch):
#   OUT=dir bash benchmarks/h200/w2_prefetch_job.sh tests   # tests/gpu: the prefetch forms, slot dedup, fused split-K
#   OUT=dir bash benchmarks/h200/w2_prefetch_job.sh ab      # same-run A/B against the default: TP8 T = 1-4 (3
#                                                           # routings), then TP4 T = 1, 2, 4 (balanced, same_k)
#   OUT=dir bash benchmarks/h200/w2_prefetch_job.sh ncu     # per-kernel durations, TP8 T = 1 and 4, default and form
# carry [".whl"] (pydantic for glm5_fp4.hardware: benchmarks/gpu_deps.sh); pass GLM5_FP4_GIT_SHA.
set -u
. benchmarks/h200/job_steps.sh || exit 2
FORMS=${FORMS:-w2_prefetch,w2_prefetch_early}
for s in "$@"; do
  case $s in
    tests)
      step tests_w2_prefetch "${T_TESTS:-300}" python3 -m pytest tests/gpu/test_moe_kernel_gpu.py -q -rA \
        -p no:cacheprovider -k "${TESTS_K:-w2_prefetch or slot_dedup or fused_split_k}" ;;
    ab)
      GREP="precompiled|T=|rror" step ab_w2_tp8 "${T_AB:-300}" python3 benchmarks/moe_variants.py --precompile 14 \
        --shards tp8 --tokens "${AB_TOKENS:-1,2,3,4}" --routings "${AB_ROUTINGS:-balanced,same_k,zipf1.2}" \
        --forms "$FORMS" --json "$OUT/variants_w2_tp8.json"
      [ "${AB1_TOKENS:-}" = none ] || GREP="precompiled|T=|rror" step ab_w2_tp4 "${T_AB1:-240}" \
        python3 benchmarks/moe_variants.py --precompile 14 --shards tp4 --tokens "${AB1_TOKENS:-1,2,4}" \
        --routings balanced,same_k --layers 2 --forms "$FORMS" --json "$OUT/variants_w2_tp4.json" ;;
    ncu)
      for t in 1 4; do for f in default ${FORMS//,/ }; do
        form=$([ "$f" = default ] || echo "--form $f")
        GREP="rror" step "ncu_tp8_t${t}_$f" "${T_NCU:-90}" ncu --clock-control none --profile-from-start off --csv \
          --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,launch__grid_size \
          python3 benchmarks/ncu_moe_call.py --shard tp8 --tokens $t $form
        cp "$L/ncu_tp8_t${t}_$f.log" "$OUT/"
      done; done ;;
  esac
done
