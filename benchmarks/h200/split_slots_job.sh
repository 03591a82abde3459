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
: "${OUT:?OUT=dir (where the results go) is required}"
. benchmarks/gpu_deps.sh || exit 2
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
L=$OUT/logs; mkdir -p "$L"
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$L/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $((SECONDS - t0))s"; grep -E "${GREP:-passed|failed|FAIL|Error|best|x balanced|ERROR}" "$L/$name.log" | tail -${TAIL:-30}; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu,power.draw --format=csv,noheader
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
    sanitize)
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 step memcheck "${T_MEMCHECK:-90}" compute-sanitizer --tool memcheck \
        --print-limit 20 python3 tests/gpu/memcheck_moe_kernel.py
      step racecheck "${T_RACECHECK:-120}" compute-sanitizer --tool racecheck --print-limit 20 \
        python3 tests/gpu/memcheck_moe_kernel.py ;;
  esac
done
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$L"
