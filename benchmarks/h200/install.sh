#!/usr/bin/env bash
# THERE, after the last piece: verify every piece and the whole, extract onto the engine's site folder, install
# glm5-fp4 from this working tree (no deps), smoke-test the engine + native libraries + our entry point; timings
# to $OUT.   Usage: bash benchmarks/h200/install.sh ENGINE   (vllm: /tmp/site, sglang: /tmp/sglang/site)
set -euo pipefail
cd "$(dirname "$0")/../.."
engine=${1:?usage: install.sh vllm|sglang}; shift
site=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks/h200'); import ship; print(ship.SETS['$engine'].site)")
if [ -f "$site/.glm5_fp4_installed" ] && [ "${FORCE:-0}" != 1 ]; then
  echo "[ship] $site already installed (FORCE=1 reinstalls)"; exit 0
fi
python3 benchmarks/h200/ship.py --engine "$engine" install "$@"
touch "$site/.glm5_fp4_installed"
