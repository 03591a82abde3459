#!/usr/bin/env bash
# One device call: GPU tests, the benchmark table, a config sweep and compute-sanitizer, each time-boxed.
# Usage on the lent H200 (repo root): OUT=/some/dir bash benchmarks/run_moe_h200.sh [sections...]
# Sections: tests variants sweep bench memcheck (default: tests sweep bench memcheck). 'variants' and 'sweep'
# both write $OUT/sweep.json, from which 'bench' takes the best plan per regime.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/moe_out}
mkdir -p "$OUT"
SECTIONS=${*:-tests sweep bench memcheck}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
for s in $SECTIONS; do
  case $s in
    tests) timeout ${T_TESTS:-150} python3 -m pytest tests/gpu/test_moe_kernel_gpu.py -q -p no:cacheprovider > "$OUT/pytest.log" 2>&1; tail -5 "$OUT/pytest.log" ;;
    bench) timeout ${T_BENCH:-170} python3 benchmarks/moe_kernel.py --stages --plans "$OUT/sweep.json" ${BENCH_ARGS:-} --json "$OUT/moe_kernel_h200.json" --md "$OUT/moe_kernel_h200.md" 2>&1 | tail -60 > "$OUT/bench.log"; tail -30 "$OUT/bench.log" ;;
    variants) timeout ${T_VARIANTS:-170} python3 benchmarks/moe_kernel.py --variants --tokens ${VAR_TOKENS:-1,16,512,4096} --tp ${VAR_TP:-8} ${VAR_PRIOR:+--prior $VAR_PRIOR} --json "$OUT/sweep.json" 2>&1 | tail -100 > "$OUT/variants.log"; grep -E "best|Error|error" "$OUT/variants.log" | tail -12 ;;
    sweep) timeout ${T_SWEEP:-130} python3 benchmarks/moe_kernel.py --sweep --tokens ${SWEEP_TOKENS:-1,16,512,4096} --tp ${SWEEP_TP:-8} --json "$OUT/sweep.json" 2>&1 | tail -150 > "$OUT/sweep.log"; tail -8 "$OUT/sweep.log" ;;
    memcheck) PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${T_MEMCHECK:-50} compute-sanitizer --tool memcheck --print-limit 20 python3 tests/gpu/memcheck_moe_kernel.py > "$OUT/memcheck.log" 2>&1; echo "memcheck rc=$?"; tail -6 "$OUT/memcheck.log" ;;
  esac
done
