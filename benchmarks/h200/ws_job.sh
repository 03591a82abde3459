#!/usr/bin/env bash
# The warp-specialised Gluon GEMM1 (Gemm1Config.ws, opt-in forms gemm1_ws*) on an H200: its GPU tests against the
# float64 reference (time-boxed: a barrier mistake hangs rather than fails), then a same-run A/B against the default.
#   OUT=dir GLM5_FP4_GIT_SHA=<sha> bash benchmarks/h200/ws_job.sh [tests] [ab] [ncu]   (FORMS, AB_*, NCU_T)
. benchmarks/h200/job_steps.sh
FORMS=${FORMS:-gemm1_ws,gemm1_ws64,gemm1_ws16}
[ $# -gt 0 ] || set -- tests ab
for what in "$@"; do
  case $what in
    tests) step ws_tests "${T_TESTS:-240}" python3 -m pytest -q -x tests/gpu/test_moe_kernel_gpu.py \
             -k warp_specialized ;;
    ncu)  # per kernel: time, DRAM share, registers, warps and the stall ratios per issued instruction
      for f in default ${FORMS//,/ }; do
        form=$([ "$f" = default ] || echo "--form $f")
        GREP="rror" step "ncu_tp8_t${NCU_T:-512}_$f" "${T_NCU:-120}" ncu --clock-control none --profile-from-start off --csv \
          --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__warps_active.avg.per_cycle_active,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum,launch__grid_size,launch__registers_per_thread,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active" \
          python3 benchmarks/ncu_moe_call.py --shard tp8 --tokens "${NCU_T:-512}" $form
        cp "$L/ncu_tp8_t${NCU_T:-512}_$f.log" "$OUT/ncu_tp8_t${NCU_T:-512}_$f.csv"
      done ;;
    ab) ab_step ws "${T_AB:-420}" "${AB_SHARDS:-tp8}" "${AB_TOKENS:-64,512,1024}" "${AB_ROUTINGS:-balanced,same_k}" 4 ;;
  esac
done
