#!/usr/bin/env bash
# H200 calls of 2026-12-03 (session 13): the slot GEMM2 split by slots (Plan.gemm2_split_slots) at T = 1-2.
#   OUT=dir bash benchmarks/h200/split_slots_job.sh ab sweep     # same-run A/B of the default and FORMS (TP8, TP4,
#                                                                # TP1), the slot GEMM2 tiles swept with and without
#                                                                # the split
#   OUT=dir bash benchmarks/h200/split_slots_job.sh ncu tests sanitize   # per-kernel times at TP8 T=1 (the default
#                                                                # and NCU_FORM), GPU tests, memcheck and racecheck
# The first call (8deb18e, the split an opt-in form) ran FORMS=split_slots,split_slots_pdl,pdl NCU_FORM=split_slots;
# the second (811a4d6, the split the default in its swept tile) FORMS=one_program_gemm2,pdl; the third (the wide
# GEMM1 split with PDL the default at T <= 2) the former default, the former GEMM1 picks, and no PDL.
set -u
. benchmarks/h200/job_steps.sh || exit 2
FORMS=${FORMS:-one_program_gemm2,slot_split_pow2,nopdl}
for s in "$@"; do
  case $s in
    ab)
      GREP="default|split|pdl" step ab_tp8_tp4 "${T_AB:-200}" python3 benchmarks/moe_variants.py --shards tp8,tp4 \
        --tokens 1,2 --routings balanced,same_k --forms $FORMS --json "$OUT/variants_split_slots.json"
      GREP="default|split|pdl" step ab_tp1 "${T_AB1:-150}" python3 benchmarks/moe_variants.py --shards tp1 \
        --tokens 1,2 --routings balanced --layers 2 --forms $FORMS --json "$OUT/variants_split_slots_tp1.json" ;;
    sweep)
      step sweep "${T_SWEEP:-200}" python3 benchmarks/moe_kernel.py --sweep --only '^g2|slots' --shards tp8 \
        --tokens 1,2 --layers 4 --json "$OUT/sweep_split_slots.json" ;;
    ncu)
      for f in default ${NCU_FORM:-one_program_gemm2}; do
        GREP="==PROF==|rror" step "ncu_t1_$f" "${T_NCU:-90}" ncu --clock-control none --profile-from-start off --csv \
          --page details --section SpeedOfLight --section LaunchStats --section Occupancy \
          python3 benchmarks/ncu_moe_call.py --shard tp8 --tokens 1 $( [ $f = default ] || echo --form $f )
        cp "$L/ncu_t1_$f.log" "$OUT/ncu_tp8_t1_$f.csv"; done ;;
    tests)
      step tests "${T_TESTS:-200}" python3 -m pytest tests/gpu/test_moe_kernel_gpu.py -q -p no:cacheprovider \
        -k "split_slots or pdl_matches or cuda_graph or balanced_matches or fused_split_k" ;;
    sanitize) sanitize_steps ;;
  esac
done
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$L"
