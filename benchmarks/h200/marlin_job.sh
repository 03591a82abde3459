#!/usr/bin/env bash
# Issue 13 goal 5 on the current defaults: vLLM 0.26's Marlin MoE beside our kernel in the same run, run in the
# background (benchmarks/device_bg.sh) while vLLM's pieces arrive. Before vLLM is there: the whole GPU test file and
# the T <= 2 read floor (benchmarks/small_t_floor.py); then, once install.sh has put vLLM on /tmp/site, the TP8 table
# (T = 1-8,192, three routings, Marlin and torch's grouped GEMMs beside ours) and the TP4 rows.
# Results to $OUT: small_t_floor.json, moe_kernel_h200{,_tp4_ep8}.{json,md}, logs.tar.gz.
# The calls (back to back: /tmp lives while the machine stays warm), with SHA = git rev-parse HEAD:
#   1. carry [".ship/p0", ".whl"]: bash benchmarks/h200_vllm/receive.sh &&
#        GLM5_FP4_GIT_SHA=SHA bash benchmarks/device_bg.sh start benchmarks/h200/marlin_job.sh
#   2-3. carry [".ship/pN"]: bash benchmarks/h200_vllm/receive.sh
#   4. carry [".ship/p3"]: bash benchmarks/h200_vllm/receive.sh && bash benchmarks/h200_vllm/install.sh
#   5. carry []: bash benchmarks/device_bg.sh wait 540; bash benchmarks/device_bg.sh collect
set -u
. benchmarks/h200/job_steps.sh || exit 2
step tests "${T_TESTS:-420}" python3 -m pytest tests/gpu/test_moe_kernel_gpu.py -q -p no:cacheprovider ${TEST_ARGS:-}
GREP="T=|rror" step small_t_floor "${T_FLOOR:-120}" python3 benchmarks/small_t_floor.py --tokens 1,2 \
  --json "$OUT/small_t_floor.json"
# Marlin needs the shipped vLLM
. benchmarks/h200_vllm/wait_env.sh
GREP="precompiled|T=|rror|marlin" step bench "${T_BENCH:-360}" python3 benchmarks/moe_kernel.py --shards tp8 \
  --tokens "${BENCH_TOKENS:-1,2,4,16,64,256,512,1024,4096,8192}" --routings "${BENCH_ROUTINGS:-balanced,same_k,zipf1.2}" \
  --layers 4 --precompile 14 --json "$OUT/moe_kernel_h200.json" --md "$OUT/moe_kernel_h200.md"
GREP="precompiled|T=|rror|marlin" step bench2 "${T_BENCH2:-240}" python3 benchmarks/moe_kernel.py --shards tp4 \
  --tokens "${BENCH2_TOKENS:-1,4,64,512,4096}" --routings "${BENCH2_ROUTINGS:-balanced,same_k}" --layers 4 \
  --no-baselines --precompile 14 --json "$OUT/moe_kernel_h200_tp4_ep8.json" --md "$OUT/moe_kernel_h200_tp4_ep8.md"
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
echo 0 > /tmp/bg/rc
