# Sourced (repo root) by the device scripts (benchmarks/run_moe_h200.sh, benchmarks/h200/*_job.sh): results under
# $OUT, logs under $OUT/logs, the GPU's state first (logs/gpu.txt), and step NAME LIMIT CMD... (CMD time-boxed to
# LIMIT s, its log under logs/, the lines matching $GREP printed with its rc and time); the sanitizer steps.
: "${OUT:?OUT=dir (where the results go) is required}"
. benchmarks/gpu_deps.sh || exit 2
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
# The device copy's .git is stale: pass the commit sent (GLM5_FP4_GIT_SHA=$(git rev-parse HEAD) here) for the results.
[ -n "${GLM5_FP4_GIT_SHA:-}" ] || echo "note: GLM5_FP4_GIT_SHA unset, results will record the stale .git of the device copy"
L=$OUT/logs; mkdir -p "$L"
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$L/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $((SECONDS - t0))s"; grep -E "${GREP:-passed|failed|FAIL|Error|best|x balanced|ERROR}" "$L/$name.log" | tail -${TAIL:-30}; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$L/gpu.txt"
# compute-sanitizer on the small fused-MoE cases (tests/gpu/memcheck_moe_kernel.py); memcheck_step NAME runs it on
# the layout in GLM5_FP4_EXPERT_LAYOUT (default: the engines' default).
memcheck_step() { PYTORCH_NO_CUDA_MEMORY_CACHING=1 step "${1:-memcheck}" "${T_MEMCHECK:-90}" compute-sanitizer \
  --tool memcheck --print-limit 20 python3 tests/gpu/memcheck_moe_kernel.py; }
racecheck_step() { step racecheck "${T_RACECHECK:-120}" compute-sanitizer --tool racecheck --print-limit 20 \
  python3 tests/gpu/memcheck_moe_kernel.py; }
sanitize_steps() { memcheck_step; racecheck_step; }
# Same-run A/B of the opt-in forms in $FORMS against the default (benchmarks/moe_variants.py), results in
# $OUT/variants_NAME.json: ab_step NAME LIMIT SHARDS TOKENS ROUTINGS LAYERS
ab_step() { GREP="precompiled|T=|rror" step "ab_$1" "$2" python3 benchmarks/moe_variants.py --precompile 14 \
  --shards "$3" --tokens "$4" --routings "$5" --layers "$6" --forms "$FORMS" --json "$OUT/variants_$1.json"; }
