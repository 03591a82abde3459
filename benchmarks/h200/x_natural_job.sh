#!/usr/bin/env bash
# Device calls of improvements/22 (the slot GEMM1 loads x in natural K order, Plan.x_natural):
#   OUT=dir bash benchmarks/h200/x_natural_job.sh tests   # tests/gpu: the x_natural forms, slot dedup, fused split-K
#   OUT=dir bash benchmarks/h200/x_natural_job.sh ab      # same-run A/B against the default: TP8 T = 1-4 (3
#                                                           # routings), then TP4 T = 1, 2, 4 (balanced, same_k)
#   OUT=dir bash benchmarks/h200/x_natural_job.sh ncu     # per-kernel durations, TP8 T = 1 and 4, default and form
# carry [".whl"] (pydantic for glm5_fp4.hardware: benchmarks/gpu_deps.sh); pass GLM5_FP4_GIT_SHA.
set -u
. benchmarks/h200/job_steps.sh || exit 2
# (the run of 1bb0455 timed FORMS=x_natural,x_prefetch against the gather, then the default; x_prefetch, an L1
# prefetch of the next K tile's x, gained nothing and is gone)
FORMS=${FORMS:-x_gathered,x_natural}
for s in "$@"; do
  case $s in
    tests)
      step tests_x_natural "${T_TESTS:-300}" python3 -m pytest tests/gpu/test_moe_kernel_gpu.py -q -rA \
        -p no:cacheprovider -k "${TESTS_K:-x_in_natural_order or slot_dedup or fused_split_k}" ;;
    ab)
      GREP="precompiled|T=|rror" step ab_x_tp8 "${T_AB:-300}" python3 benchmarks/moe_variants.py --precompile 14 \
        --shards tp8 --tokens "${AB_TOKENS:-1,2,3,4}" --routings "${AB_ROUTINGS:-balanced,same_k,zipf1.2}" \
        --forms "$FORMS" --json "$OUT/variants_x_tp8.json"
      [ "${AB1_TOKENS:-}" = none ] || GREP="precompiled|T=|rror" step ab_x_tp4 "${T_AB1:-240}" \
        python3 benchmarks/moe_variants.py --precompile 14 --shards tp4 --tokens "${AB1_TOKENS:-1,2,4}" \
        --routings balanced,same_k --layers 2 --forms "$FORMS" --json "$OUT/variants_x_tp4.json"
      [ "${AB2_TOKENS:-}" = none ] || GREP="precompiled|T=|rror" step ab_x_tp1 "${T_AB2:-240}" \
        python3 benchmarks/moe_variants.py --precompile 14 --shards tp1 --tokens "${AB2_TOKENS:-1,4}" \
        --routings balanced,same_k --layers 2 --forms "$FORMS" --json "$OUT/variants_x_tp1.json" ;;
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
