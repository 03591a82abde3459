#!/usr/bin/env bash
# One device call: GPU tests, the benchmark table, a config sweep, compute-sanitizer; each time-boxed, logs and
# results bundled so they fit the device tool's 8 returned files.
# Usage on the lent H200 (repo root): OUT=/some/dir bash benchmarks/run_moe_h200.sh [sections...]
# Sections: tests sweep bench bench2 variants ncu memcheck memcheck_placed racecheck (default: tests bench memcheck); ncu =
# Nsight Compute of one call per NCU_TOKENS (default 1,64,512,1024) x NCU_DIAG (launch.DIAG_* values, default 0) at
# NCU_SHARD / NCU_ROUTING (tp8, balanced), T_NCU seconds each, CSV under logs/; bench2 = TP4 and
# EP8 rows; variants = default vs the opt-in kernel variants in one run (benchmarks/moe_variants.py, $OUT/variants.json);
# TEST_ARGS="-k test_variant_" runs only the variants' GPU tests. 'sweep' writes
# $OUT/sweep.json; 'bench' uses it (or $PLANS) for the swept regimes. vLLM's Marlin MoE is measured beside
# ours when vLLM's CUDA build is importable (PYTHONPATH with the shipped vLLM: benchmarks/h200_vllm/).
set -u
OUT=${OUT:-/tmp/moe_out}
. benchmarks/h200/job_steps.sh || exit 2
SECTIONS=${*:-tests bench memcheck}
NCU_DIAG=${NCU_DIAG:-0}
PLANS=${PLANS:-$OUT/sweep.json}
for s in $SECTIONS; do
  case $s in
    tests) step tests "${T_TESTS:-170}" python3 -m pytest tests/gpu/test_moe_kernel_gpu.py -q -p no:cacheprovider ${TEST_ARGS:-} ;;
    sweep) step sweep "${T_SWEEP:-170}" python3 benchmarks/moe_kernel.py --sweep --shards "${SWEEP_SHARDS:-tp8}" \
             --tokens "${SWEEP_TOKENS:-1,512,1024,4096}" --layers 2 --json "$OUT/sweep.json" ;;
    bench) step bench "${T_BENCH:-170}" python3 benchmarks/moe_kernel.py --shards "${BENCH_SHARDS:-tp8}" \
             --tokens "${BENCH_TOKENS:-1,4,16,64,256,512,1024,4096,8192}" --routings "${BENCH_ROUTINGS:-balanced,same_k,zipf1.2}" \
             ${BENCH_ARGS:-} $( [ -f "$PLANS" ] && echo --plans "$PLANS" ) --json "$OUT/moe_kernel_h200.json" --md "$OUT/moe_kernel_h200.md" ;;
    bench2) step bench2 "${T_BENCH2:-120}" python3 benchmarks/moe_kernel.py --shards "${BENCH2_SHARDS:-tp4,ep8}" \
             --tokens "${BENCH2_TOKENS:-64,512,4096}" --routings "${BENCH2_ROUTINGS:-balanced,same_k,zipf1.2}" \
             ${BENCH2_ARGS:---no-baselines} --json "$OUT/moe_kernel_h200_tp4_ep8.json" --md "$OUT/moe_kernel_h200_tp4_ep8.md" ;;
    variants) step variants "${T_VARIANTS:-240}" python3 benchmarks/moe_variants.py --shards "${VARIANTS_SHARDS:-tp8}" \
             --tokens "${VARIANTS_TOKENS:-1,4,64,512,4096}" --routings "${VARIANTS_ROUTINGS:-balanced,same_k}" \
             ${VARIANTS_ARGS:-} --json "$OUT/variants.json" ;;
    ncu) # one call per NCU_TOKENS entry (and NCU_DIAG launch.DIAG_* value): speed of light, pipe utilisation,
         # stall reasons and issue slots of every kernel of the call, as CSV under logs/
         NCU_TOKENS=${NCU_TOKENS:-1,64,512,1024}
         for t in ${NCU_TOKENS//,/ }; do for d in ${NCU_DIAG//,/ }; do
           GREP="==PROF==|rror" step "ncu_${NCU_SHARD:-tp8}_t${t}_d${d}" "${T_NCU:-120}" ncu --clock-control none \
             --profile-from-start off --csv --page details --section SpeedOfLight --section ComputeWorkloadAnalysis \
             --section InstructionStats --section WarpStateStats --section SchedulerStats --section Occupancy \
             --section LaunchStats --section MemoryWorkloadAnalysis \
             --metrics "regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active,regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active" \
             python3 benchmarks/ncu_moe_call.py --shard "${NCU_SHARD:-tp8}" --tokens "$t" \
             --routing "${NCU_ROUTING:-balanced}" --diag "$d"; done; done ;;
    memcheck) memcheck_step ;;
    memcheck_placed) GLM5_FP4_EXPERT_LAYOUT=placed memcheck_step memcheck_placed ;;
    racecheck) racecheck_step ;;
  esac
done
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$L"
ls "$OUT"
