#!/usr/bin/env bash
# H200 calls of 2026-12-03 (session 12): GEMM1's weight tiles by TMA (Gemm1Config.tma) against the defaults.
#   OUT=dir bash benchmarks/h200/tma_job.sh sweep   # the TMA tiles swept beside the default (TP8, TP4), the parallel
#                                                   # align at T = 768/1024, GPU tests
#   OUT=dir bash benchmarks/h200/tma_job.sh table   # the table on the built-in defaults with Marlin (shipped
#                                                   # vLLM: . benchmarks/h200_vllm/env.sh first), memcheck
# The sweep's JSON is also kept in /tmp/tma (it survives between back-to-back calls while the machine is warm: the
# ncu probes of single TMA tiles read it).
set -u
. benchmarks/h200/job_steps.sh || exit 2
mkdir -p /tmp/tma
for s in "$@"; do
  case $s in
    sweep)
      step sweep_tp8 "${T_SWEEP:-290}" python3 benchmarks/moe_kernel.py --sweep --only 't$' --precompile 14 --shards tp8 \
        --tokens "${SWEEP_TOKENS:-1,4,64,512,1024,4096}" --layers 4 --json /tmp/tma/sweep.json
      cp /tmp/tma/sweep.json "$OUT/sweep_tma_tp8.json"
      step sweep_tp4 "${T_SWEEP4:-120}" python3 benchmarks/moe_kernel.py --sweep --only '32x(256|128)w4s[234]t$' \
        --precompile 14 --shards tp4 --tokens 512 --layers 4 --json "$OUT/sweep_tma_tp4.json"
      step palign "${T_PALIGN:-60}" python3 benchmarks/moe_variants.py --shards tp8 --tokens 768,1024 \
        --routings balanced,same_k --forms parallel_align --json "$OUT/variants_palign.json"
      step tests "${T_TESTS:-150}" python3 -m pytest tests/gpu/test_moe_kernel_gpu.py -q -p no:cacheprovider \
        -k "tma or balanced_matches or cuda_graph" ;;
    table)
      step table "${T_TABLE:-330}" python3 benchmarks/moe_kernel.py --precompile 14 --shards tp8 \
        --tokens 1,4,16,64,256,512,1024,4096,8192 --routings balanced,same_k,zipf1.2 \
        --json "$OUT/moe_kernel_h200.json" --md "$OUT/moe_kernel_h200.md"
      memcheck_step ;;
  esac
done
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$L"
