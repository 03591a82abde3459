#!/usr/bin/env bash
# The GPU gate of new kernel defaults, in the background (benchmarks/device_bg.sh) while vLLM's pieces arrive:
# same-run variants at the sizes the defaults changed (with the atomics-vs-stores stand-in), the GPU tests,
# compute-sanitizer memcheck; then, once install.sh has put vLLM on /tmp/site, the benchmark tables with Marlin.
# Results to $OUT: variants.json, moe_kernel_h200{,_tp4_ep8}.{json,md}, gate_logs.tar.gz, tables_logs.tar.gz.
set -u
export T_VARIANTS=${T_VARIANTS:-300} VARIANTS_TOKENS=${VARIANTS_TOKENS:-2048,4096,8192} VARIANTS_ARGS=${VARIANTS_ARGS:---noatomic}
OUT=$OUT/gate bash benchmarks/run_moe_h200.sh ${GATE_SECTIONS:-variants tests memcheck}
# Marlin needs the shipped vLLM
. benchmarks/h200_vllm/wait_env.sh
export T_BENCH=${T_BENCH:-420} T_BENCH2=${T_BENCH2:-240} BENCH2_SHARDS=${BENCH2_SHARDS:-tp4} \
       BENCH2_TOKENS=${BENCH2_TOKENS:-64,512,2048,4096} BENCH2_ROUTINGS=${BENCH2_ROUTINGS:-balanced,same_k} \
       BENCH2_ARGS=${BENCH2_ARGS:---layers 4}
OUT=$OUT/tables bash benchmarks/run_moe_h200.sh ${TABLE_SECTIONS:-bench bench2}
mv "$OUT/gate/logs.tar.gz" "$OUT/gate_logs.tar.gz"; mv "$OUT/tables/logs.tar.gz" "$OUT/tables_logs.tar.gz"
mv "$OUT"/gate/* "$OUT"/tables/* "$OUT/" 2>/dev/null; rmdir "$OUT/gate" "$OUT/tables"
echo 0 > /tmp/bg/rc
