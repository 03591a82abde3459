#!/usr/bin/env bash
# THERE, in the first shipping call (either engine): start making the true-dimension GLM-5 checkpoint on the GPU in
# the background (a new session, so it outlives this call while the machine stays warm); run_true_dims.py waits for
# it. Needs only the image's torch/transformers/safetensors: the package is copied to /tmp first (the call's tree
# goes).   Usage: bash benchmarks/h200/make_true_ckpt.sh [RECIPE]   glm5 (default; vLLM's run: /tmp/ckpt/glm5-true) or
# routed-only (SGLang's run: /tmp/ckpt/glm5-true-routed; true_dims.ckpt_for is the same rule).
set -euo pipefail
recipe=${1:-glm5}
case "$recipe" in
  glm5) out=/tmp/ckpt/glm5-true ;;
  routed-only) out=/tmp/ckpt/glm5-true-routed ;;
  *) echo "usage: make_true_ckpt.sh [glm5|routed-only]" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/../.."
mkdir -p /tmp/ckpt /tmp/g5src && rm -rf /tmp/g5src/glm5_fp4 /tmp/g5src/benchmarks && cp -r glm5_fp4 /tmp/g5src/
mkdir -p /tmp/g5src/benchmarks && cp -r benchmarks/h200 /tmp/g5src/benchmarks/
cd /tmp/g5src
sizes=$(PYTHONPATH=/tmp/g5src python3 -c "
import sys; sys.path.insert(0, 'benchmarks/h200')
from true_dims import true_sizes
print(' '.join(f'--size {k}={v}' for k, v in true_sizes(${LAYERS:-5}, ${DENSE:-3}).items()))")
rm -rf "$out"
PYTHONPATH=/tmp/g5src setsid nohup bash -c "python3 -m glm5_fp4.cli make-checkpoint --arch glm5 --recipe $recipe \
  --out $out --device cuda $sizes && echo ok > $out/.complete" > "$out.log" 2>&1 < /dev/null &
echo $! > "$out.pid"
echo "[ckpt] making $out ($recipe) in the background (pid $(cat "$out.pid"), log $out.log)"
