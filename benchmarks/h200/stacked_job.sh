#!/usr/bin/env bash
# H200 calls for GEMM1's stacked gate/up tile (Gemm1Config.stacked, opt-in form "stacked"; 2026-12-05): each K tile
# one [2*BN, BK] weight tile and one MMA of M = 2*BN, so the wgmmas alternate between the gate and the up accumulator
# instead of one dependent chain of BK/16 wgmmas (N = BM) per matrix after the other.
#   OUT=dir bash benchmarks/h200/stacked_job.sh ab        # same-run A/B default / stacked / default: TP8, then TP4
#   OUT=dir bash benchmarks/h200/stacked_job.sh sweep     # the stacked candidates, the 3-CTA 128-wide K tiles
#                                                         # (64x32x128 s4) on the tiled layout and GEMM2's merged
#                                                         # 64x32 tile, T = 512, 1024
#   OUT=dir bash benchmarks/h200/stacked_job.sh tests     # tests/gpu: the stacked tiles against float64
#   OUT=dir bash benchmarks/h200/stacked_job.sh former    # same-run A/B of the stacked default against the former
#                                                         # 32-token tile (opt-in "gemm1_64x32x256"), TP8 / TP4 / TP1
# carry [".whl"] (pydantic for glm5_fp4.hardware: benchmarks/gpu_deps.sh). Ran 2026-12-05: ab, sweep, tests at
# 61c6dbd (benchmarks/results/*stacked*_61c6dbd*), then the default changed and `former` + sanitize ran.
set -u
. benchmarks/h200/job_steps.sh || exit 2
for s in "$@"; do
  case $s in
    ab)
      GREP="precompiled|T=|rror" step ab_stacked_tp8 "${T_AB:-300}" python3 benchmarks/moe_variants.py --precompile 14 \
        --shards tp8 --tokens "${AB_TOKENS:-16,64,256,512,1024,2048,4096,8192}" --routings "${AB_ROUTINGS:-balanced,same_k}" \
        --forms stacked --json "$OUT/variants_stacked_tp8.json"
      GREP="precompiled|T=|rror" step ab_stacked_tp4_tp1 "${T_AB1:-200}" python3 benchmarks/moe_variants.py --precompile 14 \
        --shards tp4,tp1 --tokens "${AB1_TOKENS:-64,512,1024,4096}" --routings balanced,same_k --layers 2 --forms stacked \
        --json "$OUT/variants_stacked_tp4_tp1.json" ;;
    sweep)
      GREP="precompiled|best|rror" step sweep_stacked "${T_SWEEP:-240}" python3 benchmarks/moe_kernel.py --sweep \
        --shards tp8 --tokens "${SWEEP_TOKENS:-512,1024}" --layers 2 --only "${SWEEP_ONLY:-gu|x128w4s4$|g2 64x32w4s3 n}" \
        --precompile 14 --json "$OUT/sweep_stacked.json" ;;
    former)
      GREP="precompiled|T=|rror" step ab_former_tp8 "${T_AB:-240}" python3 benchmarks/moe_variants.py --precompile 14 \
        --shards tp8 --tokens "${AB_TOKENS:-256,512,1024,2048}" --routings balanced,same_k,zipf1.2 \
        --forms gemm1_64x32x256 --json "$OUT/variants_stacked_default_tp8.json"
      GREP="precompiled|T=|rror" step ab_former_tp4_tp1 "${T_AB1:-200}" python3 benchmarks/moe_variants.py --precompile 14 \
        --shards tp4,tp1 --tokens "${AB1_TOKENS:-512,1024}" --routings balanced,same_k --layers 2 \
        --forms gemm1_64x32x256 --json "$OUT/variants_stacked_default_tp4_tp1.json" ;;
    sanitize) sanitize_steps ;;
    tests)
      step tests_stacked "${T_TESTS:-240}" python3 -m pytest tests/gpu/test_moe_kernel_gpu.py -q -rA -p no:cacheprovider \
        -k "stacked" ;;
  esac
done
