#!/usr/bin/env bash
# The warp-specialised Gluon GEMM1 (Gemm1Config.ws, opt-in forms gemm1_ws*) on an H200: its GPU tests against the
# float64 reference (time-boxed: a barrier mistake hangs rather than fails), then a same-run A/B against the default.
#   OUT=dir GLM5_FP4_GIT_SHA=<sha> bash benchmarks/h200/ws_job.sh [tests] [ab] [ncu]
. benchmarks/h200/job_steps.sh
FORMS=${FORMS:-gemm1_ws,gemm1_ws2,gemm1_ws16}
[ $# -gt 0 ] || set -- tests ab
for what in "$@"; do
  case $what in
    tests) step ws_tests "${T_TESTS:-240}" python3 -m pytest -q -x tests/gpu/test_moe_kernel_gpu.py -k warp_specialized ;;
    ab) ab_step ws "${T_AB:-420}" "${AB_SHARDS:-tp8}" "${AB_TOKENS:-64,512,1024}" "${AB_ROUTINGS:-balanced,same_k}" 4 ;;
  esac
done
