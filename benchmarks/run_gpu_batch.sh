#!/usr/bin/env bash
# One device call on a 2-GPU H200 machine: every GPU measurement except the kernel benchmark
# (benchmarks/run_moe_h200.sh): CUDA graphs, layer timers + real traces (NCCL, our kernel), NCCL all-reduce,
# telemetry, selftest. Each step is time-boxed; results are bundled into $OUT/gpu_batch.tar.gz.
# Usage (repo root): OUT=/dir bash benchmarks/run_gpu_batch.sh [steps...]   (default: all steps)
set -u
OUT=${OUT:-/tmp/gpu_batch}
. benchmarks/gpu_deps.sh || exit 2
export PYTHONUNBUFFERED=1
R=$OUT/batch; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv | tee "$R/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$R/gpu.txt"
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$R/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $((SECONDS - t0))s"; tail -${TAIL:-12} "$R/$name.log"; }
STEPS=${*:-cuda_graphs selftest layer_timers allreduce telemetry}
want() { [[ " $STEPS " == *" $1 "* ]]; }
want cuda_graphs && step cuda_graphs 150 python3 benchmarks/cuda_graphs.py --out "$R/cuda_graphs_h200.json" --steps 10
want selftest && step selftest 120 python3 -m glm5_fp4.cli selftest --quick --out "$R/selftest"
want layer_timers && step layer_timers 170 python3 benchmarks/gpu_layer_timers.py --out "$R/layer_timers" --timeout-s 160
want allreduce && step allreduce 60 python3 benchmarks/allreduce.py --out "$R/allreduce_h200.json" --iters 30
want telemetry && step telemetry 75 python3 benchmarks/gpu_telemetry.py --out "$R/telemetry" --idle 5 --load 15 --pcie 2 --tail 6 --cpu-seconds 3
tar czf "$OUT/gpu_batch.tar.gz" -C "$OUT" batch && rm -rf "$R"
ls -la "$OUT"
