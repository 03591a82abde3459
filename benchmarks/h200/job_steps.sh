# Sourced (repo root) by the benchmarks/h200/*_job.sh device scripts: results under $OUT, logs under $OUT/logs, the
# GPU's state first, and step NAME LIMIT CMD... (CMD time-boxed to LIMIT s, its log under logs/, the lines matching
# $GREP printed with its rc and time); sanitize_steps.
: "${OUT:?OUT=dir (where the results go) is required}"
. benchmarks/gpu_deps.sh || exit 2
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
L=$OUT/logs; mkdir -p "$L"
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$L/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $((SECONDS - t0))s"; grep -E "${GREP:-passed|failed|FAIL|Error|best|x balanced|ERROR}" "$L/$name.log" | tail -${TAIL:-30}; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu,power.draw --format=csv,noheader
# compute-sanitizer memcheck and racecheck on the small fused-MoE cases (tests/gpu/memcheck_moe_kernel.py)
sanitize_steps() {
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 step memcheck "${T_MEMCHECK:-90}" compute-sanitizer --tool memcheck \
    --print-limit 20 python3 tests/gpu/memcheck_moe_kernel.py
  step racecheck "${T_RACECHECK:-120}" compute-sanitizer --tool racecheck --print-limit 20 \
    python3 tests/gpu/memcheck_moe_kernel.py; }
