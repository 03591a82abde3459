#!/usr/bin/env bash
# Device calls of the 256-token GEMM1 blocks (configs.GEMM1_CANDIDATES sm90, bm = 256; written 2026-12-06):
#   OUT=dir bash benchmarks/h200/block256_job.sh tests    # tests/gpu: test_gemm1_256_token_blocks
#   OUT=dir bash benchmarks/h200/block256_job.sh sweep    # TP8 T = 4096 / 8192, balanced then all tokens on 8 experts:
#                                                         # the default against the 256-token tiles (one run each)
#   OUT=dir bash benchmarks/h200/block256_job.sh sweep4   # the same at TP4
# carry [".whl"]; pass GLM5_FP4_GIT_SHA.
set -u
. benchmarks/h200/job_steps.sh || exit 2
for s in "$@"; do
  case $s in
    tests)
      step tests_block256 "${T_TESTS:-300}" python3 -m pytest tests/gpu/test_moe_kernel_gpu.py -q -rA \
        -p no:cacheprovider -k "256_token_blocks" ;;
    sweep|sweep4)
      shard=$([ "$s" = sweep ] && echo tp8 || echo tp4)
      for r in ${ROUTINGS:-balanced same_k}; do
        GREP="precompiled|best|rror|default|x256" step "sweep_${shard}_$r" "${T_SWEEP:-280}" python3 \
          benchmarks/moe_kernel.py --sweep --shards "$shard" --tokens "${TOKENS:-4096,8192}" --layers 2 \
          --sweep-routing "$r" --only "${ONLY:-x256}" --precompile 14 --json "$OUT/sweep_block256_${shard}_$r.json"
      done ;;
  esac
done
